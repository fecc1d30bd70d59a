"""Collectives for sequence parallelism (no autograd at this level)."""
from .scan import (DECAY, MATRIX, P2PLink, Transition, chain_scan, gather_scan, global_rank, group_rank_size,
                   local_scan, prefix_scans, split_blocks, tree_scan, wait_all)
from .all_scan import (ALGORITHMS, OVERLAP, TRANSPORTS, AllScanArgs, ScanWork, all_scan, best_n_blocks, chain_time,
                       choose_algorithm, hier_groups_needed, in_one_node, on_side_stream, pair_scan,
                       tree_time)
from .buffers import group_key
from .hierarchical import init_node_groups
from .symm import SymmLink

__all__ = ["ALGORITHMS", "OVERLAP", "TRANSPORTS", "AllScanArgs", "DECAY", "MATRIX", "P2PLink", "ScanWork", "SymmLink",
           "Transition", "all_scan", "best_n_blocks", "chain_scan", "chain_time", "choose_algorithm",
           "gather_scan", "global_rank", "group_key", "group_rank_size", "hier_groups_needed", "in_one_node",
           "init_node_groups", "local_scan", "on_side_stream", "pair_scan", "prefix_scans", "split_blocks", "tree_scan",
           "tree_time", "wait_all"]
