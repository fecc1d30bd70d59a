"""Benchmarks reproducing the paper's Table 2 (bench_comm), Tables 3-4 (bench_op) and Figs. 3-4 (plot)."""
