"""Packed documents under sequence parallelism: the global cu_seqlens seen from one rank's slice."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lingua_zeco.kernels import acc_dtype


@dataclass
class LocalSegments:
    cu_seqlens: torch.Tensor | None   # boundaries inside the slice, local coordinates, [0, ..., T_local]
    first_end: int                    # tokens [0, first_end) continue the previous rank's document
    n_segments: int

    @property
    def continues(self) -> bool:
        """Whether the slice's first token continues a document from the previous rank (uses S_in)."""
        return self.first_end > 0

    @property
    def carries(self) -> bool:
        """Whether S_in reaches the slice's end state (no document starts inside the slice)."""
        return self.cu_seqlens is None or self.n_segments == 1 and self.first_end > 0


def local_segments(cu_seqlens: torch.Tensor | None, pos: int, T_local: int, device) -> LocalSegments:
    """Cut the global boundaries to rank `pos`'s slice [pos·T_local, (pos+1)·T_local)."""
    if cu_seqlens is None:
        return LocalSegments(None, T_local, 1)
    start, end = pos * T_local, (pos + 1) * T_local
    # set: a zero-length document holds no token and its boundary is the next one's, so the local
    # segments leave it out (the kernels never see an empty segment; the result is the same)
    inside = sorted({int(c) - start for c in cu_seqlens.tolist() if start < int(c) < end})
    bounds = [0, *inside, T_local]
    doc_starts_here = start in set(int(c) for c in cu_seqlens.tolist())
    first_end = 0 if doc_starts_here else bounds[1]
    cu = torch.tensor(bounds, dtype=torch.long, device=device)
    return LocalSegments(cu, first_end, len(bounds) - 1)


def incoming_decay(g_BTHK: torch.Tensor, seg: LocalSegments) -> torch.Tensor:
    """b_t = exp(Σ_{u≤t} g_u) in fp32 (fp64 for fp64 g) for tokens that still see S_in, 0 after the first boundary."""
    b_BTHK = g_BTHK.to(acc_dtype(g_BTHK.dtype)).cumsum(1).exp()
    if seg.first_end < g_BTHK.shape[1]:
        b_BTHK = torch.cat([b_BTHK[:, :seg.first_end], b_BTHK.new_zeros(b_BTHK[:, seg.first_end:].shape)], 1)
    return b_BTHK
