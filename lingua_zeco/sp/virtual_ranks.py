"""P virtual ranks of one SP group in one process (one GPU): the All-Scan each rank would receive.

`VirtualScan(P).scan_fn(p)` is rank p's `scan_fn` for FusedZeCOGLA. Run the ranks' forwards in
order 0..P-1 and their backwards in order P-1..0 (each rank's scan needs the states of the ranks
before it, each reverse scan the gradients of the ranks after it). With side_stream=True the
exchange runs through comm's side-stream path (the one the asynchronous All-Scan takes), after a
GPU-side delay, so that a caller that reads the result without waiting reads it too early.
`drop="S_in"` / `drop="G"` return zeros instead: broken variants that tests must catch.
`middle_rank_scan(S_in, G)`: one rank alone with a fixed incoming state and gradient (benchmarks).
"""
from __future__ import annotations

import torch

from lingua_zeco.comm import ScanWork, local_scan, on_side_stream


class VirtualScan:
    def __init__(self, P: int, side_stream: bool = False, delay_cycles: int = 2_000_000, drop: str | None = None):
        if drop not in (None, "S_in", "G"):
            raise ValueError(f"drop must be None, 'S_in' or 'G', got {drop!r}")
        self.P, self.side_stream, self.delay_cycles, self.drop = P, side_stream, delay_cycles, drop
        self._sent = ({}, {})  # forward, reverse: rank -> (a, x)

    def scan_fn(self, p: int):
        def fn(x_BHKV, a_BHK, reverse):
            sent = self._sent[int(reverse)]
            sent[p] = (a_BHK, x_BHKV)
            before = range(p + 1, self.P)[::-1] if reverse else range(p)  # the earlier ranks, farthest first
            missing = [r for r in before if r not in sent]
            if missing:
                raise RuntimeError(f"virtual rank {p}: ranks {missing} have not run their "
                                   f"{'backward' if reverse else 'forward'} yet")
            dropped = self.drop == ("G" if reverse else "S_in")

            def run():
                if self.side_stream and self.delay_cycles:
                    torch.cuda._sleep(self.delay_cycles)
                y_BHKV = local_scan((sent[r] for r in before), x_BHKV)  # y ← a_r ⊙ y + x_r: the decay scan
                return y_BHKV * 0 if dropped else y_BHKV

            if self.side_stream and x_BHKV.is_cuda:
                return on_side_stream(run, (x_BHKV, a_BHK))
            return ScanWork(run())
        return fn


def middle_rank_scan(S_in_BHKV, G_BHKV):
    """A scan_fn that hands back fixed tensors at once: S_in forward, G backward (no communication)."""
    def fn(x_BHKV, a_BHK, reverse):
        return ScanWork(G_BHKV if reverse else S_in_BHKV)
    return fn
