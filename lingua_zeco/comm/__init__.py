"""Collectives for sequence parallelism (no autograd at this level)."""
from .scan import (DECAY, MATRIX, Transition, chain_scan, gather_scan, global_rank, group_rank_size, local_scan,
                   scan_position, split_blocks, tree_scan, wait_all)
from .all_scan import (ALGORITHMS, AllScanArgs, ScanWork, all_scan, best_n_blocks, chain_time, choose_algorithm,
                       hier_groups_needed, on_side_stream, pair_scan, tree_time)
from .hierarchical import init_node_groups

__all__ = ["ALGORITHMS", "AllScanArgs", "DECAY", "MATRIX", "ScanWork", "Transition", "all_scan", "best_n_blocks",
           "chain_scan", "chain_time", "choose_algorithm", "gather_scan", "global_rank", "group_rank_size",
           "hier_groups_needed", "init_node_groups", "local_scan", "on_side_stream", "pair_scan", "scan_position",
           "split_blocks", "tree_scan", "tree_time", "wait_all"]
