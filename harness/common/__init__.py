"""Errors and small helpers shared by every layer of kvscope.harness (no I/O of its own)."""
