"""Test doubles, kept out of the installed package: the fault-injecting OpenAI-compatible mock server
(`faultserver`, also the benchmarks' mock: `python -m tests.doubles.faultserver`, run from the repository root)
and the scripted openai-SDK agent (`scripted_agent`). Nothing under `harness/` or `workloads/` imports them
(tests/test_architecture.py checks)."""
