"""Input checks for sp_gla: local ones always, a cross-rank agreement check on the first calls.

Ranks that disagree on shapes would otherwise block in a point-to-point receive of the wrong size.
The cross-rank check is one small all-gather; it runs for the first CROSS_CHECK_CALLS calls of a
process (every rank counts the same calls, so no rank skips a collective another one enters) and
always when LINGUA_ZECO_SP_CHECK=1.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

SP_METHODS = ("zeco", "lasp1", "lasp2", "none")  # what a run may choose (distributed.sp_method)
DIAGNOSTIC_METHODS = ("local",)  # drops S_in (wrong on purpose): tests use it to show they can fail
METHODS = SP_METHODS + DIAGNOSTIC_METHODS
CROSS_CHECK_CALLS = 64
_calls = {"n": 0}
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def check_local(q, k, v, g, method, packing, P):
    """packing: None or the step's lingua_zeco.sp.varlen.Packing (its boundaries were checked when planned)."""
    if method not in METHODS:
        raise ValueError(f"sp_gla: method must be one of {METHODS}, got {method!r}")
    if method == "none" and P > 1:
        raise ValueError(f"sp_gla: method 'none' runs on a group of one rank, this group has {P}; "
                         "choose zeco, lasp1 or lasp2 (or sp_size=1)")
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"sp_gla: q, k, g must share one shape [B, T_local, H, K]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, g {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"sp_gla: v must be [B, T_local, H, V] matching q {tuple(q.shape)}; got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES or g.dtype not in _DTYPES:
        raise ValueError(f"sp_gla: q, k, v need one floating dtype and g a floating dtype; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}, g {g.dtype}")
    if packing is not None:
        if q.shape[0] != 1:
            raise ValueError(f"sp_gla: cu_seqlens needs B = 1 (pack the documents into one sequence); "
                             f"got B = {q.shape[0]}")


def _signature(q, v, g, packing) -> list[int]:
    B, T, H, K = q.shape
    cu = 0 if packing is None else hash(packing.boundaries) % (1 << 31)
    return [B, T, H, K, v.shape[-1], _DTYPES.index(q.dtype), _DTYPES.index(g.dtype), cu]


def check_across_ranks(q, v, g, packing, group, P):
    _calls["n"] += 1
    if P == 1 or (_calls["n"] > CROSS_CHECK_CALLS and os.environ.get("LINGUA_ZECO_SP_CHECK") != "1"):
        return
    device = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(_signature(q, v, g, packing), dtype=torch.long, device=device)
    every = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    if any(r != rows[0] for r in rows):
        names = "B T_local H K V dtype(q) dtype(g) cu_seqlens".split()
        diffs = [f"rank {i}: " + ", ".join(f"{n}={x}" for n, x in zip(names, r)) for i, r in enumerate(rows)]
        raise ValueError("sp_gla: the ranks of the SP group disagree on their inputs (each rank must pass "
                         "the same B, T_local, H, K, V, dtypes and cu_seqlens):\n  " + "\n  ".join(diffs))
