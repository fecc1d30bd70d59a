"""Collectives for sequence parallelism (no autograd at this level)."""
from .gather_scan import gather_scan
from .all_scan import (ALGORITHMS, AllScanArgs, ScanWork, all_scan, best_n_blocks, chain_time, choose_algorithm,
                       on_side_stream, tree_time)

__all__ = ["ALGORITHMS", "AllScanArgs", "ScanWork", "all_scan", "best_n_blocks", "chain_time", "choose_algorithm",
           "gather_scan", "on_side_stream", "tree_time"]
