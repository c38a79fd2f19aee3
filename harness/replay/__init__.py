"""Replay a trace through a serving endpoint: session timing, the request loop, predictions, /metrics watch, summary."""
