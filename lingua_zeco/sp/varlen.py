"""Packed documents under sequence parallelism, planned once per step on the host.

`pack(cu_seqlens, rank=, P=, T_local=, device=)` turns the loader's global boundaries into a `Packing`:
the boundaries on the host, once on the device, and this rank's `LocalSegments`. The model builds it
once per step and hands the same object to every layer, so no layer reads boundaries back from the
GPU (`.tolist()`, `.item()`) or copies them to it in its forward or backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lingua_zeco.kernels import acc_dtype
from lingua_zeco.kernels.common import to_device, varlen_chunk_tables


@dataclass(eq=False)
class LocalSegments:
    cu_seqlens: torch.Tensor | None   # boundaries inside the slice, local coordinates, [0, ..., T_local]
    first_end: int                    # tokens [0, first_end) continue the previous rank's document
    n_segments: int
    bounds: tuple[int, ...] = ()      # cu_seqlens on the host
    _chunks: dict = field(default_factory=dict, repr=False)

    @property
    def continues(self) -> bool:
        """Whether the slice's first token continues a document from the previous rank (uses S_in)."""
        return self.first_end > 0

    @property
    def carries(self) -> bool:
        """Whether S_in reaches the slice's end state (no document starts inside the slice)."""
        return self.cu_seqlens is None or self.n_segments == 1 and self.first_end > 0

    def chunk_index(self, BT: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """fla's varlen chunk tables for chunk size BT, made on the host once per step: chunk_indices
        [NT, 2] (document, chunk in document), chunk_offsets [N + 1] (first chunk of each document)
        and NT, so that fla's stages need not read them back from the GPU."""
        if BT not in self._chunks:
            self._chunks[BT] = varlen_chunk_tables(self.bounds, BT, self.cu_seqlens.device)
        return self._chunks[BT]


@dataclass(eq=False)
class Packing:
    """One packed sequence of documents split over an SP group of P ranks, seen from `rank`."""
    boundaries: tuple[int, ...]   # global cu_seqlens, 0 … P·T_local (host)
    cu_seqlens: torch.Tensor      # the same on the device (long)
    rank: int
    P: int
    T_local: int
    seg: LocalSegments            # this rank's slice


def check_boundaries(bounds, total: int, where: str = "sp_gla") -> None:
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
        shown = f"{list(bounds[:4])}...{list(bounds[-2:])}" if len(bounds) > 6 else list(bounds)
        raise ValueError(f"{where}: cu_seqlens must be the non-decreasing boundaries of the whole packed sequence, "
                         f"from 0 to P·T_local = {total}; got {shown}")


def pack(cu_seqlens, *, rank: int, P: int, T_local: int, device) -> Packing:
    """Plan the packed documents once: cu_seqlens (tensor on any device, or ints) of the whole sequence."""
    bounds = tuple(int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens))
    check_boundaries(bounds, P * T_local)
    if torch.is_tensor(cu_seqlens) and cu_seqlens.device == torch.device(device) and cu_seqlens.dtype == torch.long:
        cu_dev = cu_seqlens
    else:
        cu_dev = to_device(bounds, device)
    return Packing(bounds, cu_dev, rank, P, T_local, local_segments(bounds, rank, T_local, device))


def as_packing(cu_seqlens, *, rank: int, P: int, T_local: int, device) -> Packing | None:
    """None stays None; a Packing is checked against this slice; boundaries are planned (once per call:
    callers that run many layers plan once with `pack` and pass the Packing)."""
    if cu_seqlens is None or isinstance(cu_seqlens, Packing):
        if cu_seqlens is not None and (cu_seqlens.P, cu_seqlens.T_local, cu_seqlens.rank) != (P, T_local, rank):
            raise ValueError(f"sp: the Packing was planned for rank {cu_seqlens.rank} of {cu_seqlens.P} with "
                             f"T_local={cu_seqlens.T_local}; this call is rank {rank} of {P} with T_local={T_local}")
        return cu_seqlens
    return pack(cu_seqlens, rank=rank, P=P, T_local=T_local, device=device)


def local_segments(bounds, pos: int, T_local: int, device) -> LocalSegments:
    """Cut the global boundaries (host ints, or None: one dense sequence) to rank `pos`'s slice
    [pos·T_local, (pos+1)·T_local)."""
    if bounds is None:
        return LocalSegments(None, T_local, 1)
    start, end = pos * T_local, (pos + 1) * T_local
    # set: a zero-length document holds no token and its boundary is the next one's, so the local
    # segments leave it out (the kernels never see an empty segment; the result is the same)
    inside = sorted({c - start for c in bounds if start < c < end})
    local = (0, *inside, T_local)
    first_end = 0 if start in set(bounds) else local[1]
    return LocalSegments(to_device(local, device), first_end, len(local) - 1, local)


def incoming_decay(g_BTHK: torch.Tensor, seg: LocalSegments) -> torch.Tensor:
    """b_t = exp(Σ_{u≤t} g_u) in fp32 (fp64 for fp64 g) for tokens that still see S_in, 0 after the first boundary."""
    b_BTHK = g_BTHK.to(acc_dtype(g_BTHK.dtype)).cumsum(1).exp()
    if seg.first_end < g_BTHK.shape[1]:
        b_BTHK = torch.cat([b_BTHK[:, :seg.first_end], b_BTHK.new_zeros(b_BTHK[:, seg.first_end:].shape)], 1)
    return b_BTHK
