"""Benchmarks report ratios against a baseline measured in the same run; they never assert on time."""
