"""Benchmarks: each script measures raoe against a reference in the same run and writes benchmarks/results/."""
