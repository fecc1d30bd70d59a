"""Collectives for sequence parallelism (no autograd at this level)."""
from .gather_scan import gather_scan
from .all_scan import (ALGORITHMS, AllScanArgs, ScanWork, all_scan, best_n_blocks, chain_time, choose_algorithm,
                       hier_groups_needed, on_side_stream, tree_time)
from .hierarchical import init_node_groups

__all__ = ["ALGORITHMS", "AllScanArgs", "ScanWork", "all_scan", "best_n_blocks", "chain_time", "choose_algorithm",
           "gather_scan", "hier_groups_needed", "init_node_groups", "on_side_stream", "tree_time"]
