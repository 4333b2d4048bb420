"""Benchmarks: contenders side by side in one run, printing ratio tables, writing JSON and PNG."""
