"""Collectives for sequence parallelism (no autograd at this level)."""
from .all_scan import (ALGORITHMS, AllScanArgs, ScanWork, all_scan, best_n_blocks, chain_time, choose_algorithm,
                       tree_time)

__all__ = ["ALGORITHMS", "AllScanArgs", "ScanWork", "all_scan", "best_n_blocks", "chain_time", "choose_algorithm",
           "tree_time"]
