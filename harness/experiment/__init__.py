"""Experiments: server configurations x workloads x loads x repeats, run cell by cell with resume."""
