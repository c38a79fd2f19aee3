"""kvscope.harness: everything that runs, models or reports on serving (kvscope.workloads sits below it)."""
