"""What every GLA-family backend shares: the choice of backend, the accumulation dtype, the segments.

The backend follows the device (CUDA with fla importable → fla, otherwise torch); force one with
`backend=` or the environment variable LINGUA_ZECO_GLA_BACKEND.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import os
from dataclasses import dataclass

import torch

BACKENDS = ("fla", "torch")


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    """How fla's stages see a sequence: chunks of BT tokens, and for packed documents (B = 1) the boundaries
    cu_seqlens with fla's chunk tables planned on the host (varlen_chunk_tables), so that no stage reads them
    back from the GPU: chunk_indices [NT, 2] (document, chunk in document), chunk_offsets [N + 1] (first chunk
    of each document) and NT = n_chunks."""
    BT: int
    cu_seqlens: torch.Tensor | None = None
    chunk_indices: torch.Tensor | None = None
    chunk_offsets: torch.Tensor | None = None
    n_chunks: int = 0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def chunks(self, T: int) -> int:
        """NT, the chunks of a call of T tokens per row: its rows' chunks (each of the B rows has NT), or all the
        packed documents' chunks."""
        return self.n_chunks if self.packed else -(-T // self.BT)

    @property
    def varlen(self) -> dict:
        """The keywords fla's intra-chunk and output stages take."""
        return dict(cu_seqlens=self.cu_seqlens, chunk_size=self.BT, chunk_indices=self.chunk_indices)


_FLA_AVAILABLE: list[bool] = []  # the answer, once known


# a constant to torch.compile: compiled blocks do not trace the import (nor Dynamo a functools cache)
@torch.compiler.assume_constant_result
def fla_available() -> bool:
    if not _FLA_AVAILABLE:
        try:
            import fla.ops.gla  # noqa: F401
            _FLA_AVAILABLE.append(torch.cuda.is_available())
        except Exception:  # ImportError, or Triton refusing this platform
            _FLA_AVAILABLE.append(False)
    return _FLA_AVAILABLE[0]


def pick_backend(device: torch.device, backend: str | None = None) -> str:
    backend = backend or os.environ.get("LINGUA_ZECO_GLA_BACKEND") or None
    if backend is None:
        return "fla" if device.type == "cuda" and fla_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"GLA backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "fla" and not (device.type == "cuda" and fla_available()):
        raise RuntimeError("GLA backend 'fla' needs a CUDA tensor and an importable fla (pip install "
                           "flash-linear-attention); use backend='torch' on this machine")
    return backend


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype states, decays and sums accumulate in: fp32 at least, fp64 when an input is fp64
    (the exactness checks run in fp64)."""
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


def chunked(x: torch.Tensor, BT: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, X] -> [B, N, BT, H, X] in dtype, the last chunk padded with zero rows (the intra-chunk oracles)."""
    B, T, H, X = x.shape
    return torch.nn.functional.pad(x.to(dtype), (0, 0, 0, 0, 0, (-T) % BT)).view(B, -1, BT, H, X)


def intra_chunk_decays(g_BNCHK: torch.Tensor, T: int) -> torch.Tensor:
    """E [B, N, t, j, H, K] = 2^(g_t − g_j) for j ≤ t inside each chunk of the chunked base-2 gate cumsum, 0 above
    the diagonal and for the padded rows past T (the intra-chunk oracles)."""
    BT = g_BNCHK.shape[2]
    t_C = torch.arange(BT, device=g_BNCHK.device)
    valid_NC = (torch.arange(g_BNCHK.shape[1] * BT, device=g_BNCHK.device) < T).view(-1, BT)
    keep_NTJ = (t_C[:, None] >= t_C[None, :]) & valid_NC[:, :, None] & valid_NC[:, None, :]
    diff = g_BNCHK[:, :, :, None] - g_BNCHK[:, :, None, :]
    return torch.exp2(diff.masked_fill(~keep_NTJ[None, :, :, :, None, None], float("-inf")))


def segments(B: int, T: int, cu_seqlens) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of each sequence: the B rows, or the documents of a packed row (B = 1)."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = [int(c) for c in cu_seqlens.tolist()]
    return [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]


def by_segments(fixed, q, *inputs, scale, initial_state, output_final_state, cu_seqlens, chunk: int):
    """fla's contract from `fixed(q, *inputs, scale, h0, chunk) -> (o, final state)` on equal-length
    sequences: the batch at once, or each packed document from its own initial state. fp32 inside
    whatever the autocast state, as fla's kernels accumulate (autocast would cast the matmuls)."""
    with torch.autocast(q.device.type, enabled=False):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if cu_seqlens is None:
            o, ht = fixed(q, *inputs, scale, initial_state, chunk)
            return o.to(q.dtype), (ht if output_final_state else None)
        outs, finals = [], []
        for n, (_, s, e) in enumerate(segments(1, q.shape[1], cu_seqlens)):
            h0 = None if initial_state is None else initial_state[n:n + 1]
            o, ht = fixed(*(t[:, s:e] for t in (q, *inputs)), scale, h0, chunk)
            outs.append(o)
            finals.append(ht)
        return torch.cat(outs, dim=1).to(q.dtype), (torch.cat(finals) if output_final_state else None)


# -- packed documents: fla's chunk tables; which document a global token is in, and where in it -----
def to_device(rows, device) -> torch.Tensor:
    """Host ints as a long tensor on `device`; to a GPU from pinned memory, asynchronously (a plain
    copy from pageable memory would wait for the GPU's queue: a host sync)."""
    t = torch.tensor(rows, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def varlen_chunk_tables(bounds, BT: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """fla's varlen chunk tables for documents with boundaries `bounds` (host ints), each chunked from
    its own start: chunk_indices [NT, 2] (document, chunk in document), chunk_offsets [N + 1] (first
    chunk of each document) on `device`, and NT on the host, so no stage reads them back."""
    n_N = [-(-(b - a) // BT) for a, b in zip(bounds, bounds[1:])]
    rows = [(d, c) for d, n in enumerate(n_N) for c in range(n)]
    offsets = [0, *itertools.accumulate(n_N)]
    return to_device(rows, device).reshape(-1, 2), to_device(offsets, device), offsets[-1]


def chunk_layout(BT: int, docs=None) -> ChunkLayout:
    """docs: None (dense sequences); a long tensor of packed-document boundaries (the tables are planned here,
    which reads it back once); or documents planned on the host, an object with `.cu_seqlens` and
    `.chunk_index(BT) -> (chunk_indices, chunk_offsets, NT)` (lingua_zeco.sp.varlen.LocalSegments)."""
    if getattr(docs, "cu_seqlens", docs) is None:  # dense, also a dense slice's LocalSegments
        return ChunkLayout(BT)
    if torch.is_tensor(docs):
        return ChunkLayout(BT, docs, *varlen_chunk_tables([int(b) for b in docs.tolist()], BT, docs.device))
    return ChunkLayout(BT, docs.cu_seqlens, *docs.chunk_index(BT))


def _bounds_on(bounds, device) -> torch.Tensor:
    cu = bounds if torch.is_tensor(bounds) else torch.tensor(list(bounds), dtype=torch.long)
    return cu.to(device=device, dtype=torch.long)


def doc_ids(bounds, start: int, n: int, device) -> torch.Tensor:
    """The document index [n] (long) of global tokens [start, start + n) under boundaries `bounds`
    (host ints, or a long tensor already on `device`: no host sync). right=True skips zero-length
    documents: a token belongs to the last document starting at or before it."""
    pos = torch.arange(start, start + n, device=device)
    return torch.searchsorted(_bounds_on(bounds, device), pos, right=True) - 1


def doc_offsets(bounds, start: int, n: int, device) -> torch.Tensor:
    """The position [n] (long) of global tokens [start, start + n) inside their documents (as doc_ids)."""
    cu = _bounds_on(bounds, device)
    return torch.arange(start, start + n, device=device) - cu[doc_ids(cu, start, n, device)]


def doc_of(bounds, t: int) -> int:
    """The document index of global token t on the host (as doc_ids)."""
    return bisect.bisect_right(bounds, t) - 1
