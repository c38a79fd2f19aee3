"""Test doubles: a loopback OpenAI-compatible server that fails on purpose, for tests and benchmarks."""
