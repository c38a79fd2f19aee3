"""Talking to a serving engine: server lifecycle, facts, Prometheus metrics, the streaming HTTP client."""
