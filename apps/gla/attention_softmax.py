"""Causal softmax attention with RoPE for hybrid models (model.softmax_layers), sequence-parallel through
lingua_zeco.sp.softmax.sp_softmax_attention (distributed.softmax_sp = allgather | ring).

Parameter names and RoPE follow fla's hybrid GLA (GLAConfig.attn -> fla.layers.attn.Attention), so that
export is a renaming: attn.{q,k,v,o}_proj without bias, width model.dim, model.n_heads heads of
dim / n_heads, rotary embedding in GPT-NeoX layout (the two halves of each head rotate together,
inverse frequencies theta^(-2i/D)), angles in fp32 (fp64 for fp64 models), the window as flash-attn's
(window - 1, 0): a query sees itself and the window - 1 tokens before it.

Positions. Rank p of P holds the global tokens [p·T_local, (p+1)·T_local); q and k are rotated at
their GLOBAL positions before the exchange, so every rank's keys arrive rotated consistently. With
packed documents (a `Packing`) the position is the token's offset inside its document, as fla's
rotary does with cu_seqlens: a document is encoded the same wherever the packer put it (and whichever
rank holds it). RoPE scores depend only on position differences and attention never crosses a document
boundary, so this equals global positions in exact arithmetic; the in-document positions keep the
fp32 angles small (as exact as a short sequence's) and match fla's varlen convention.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from apps.gla.layers import GLAArgs
from lingua_zeco.kernels.common import acc_dtype, doc_offsets
from lingua_zeco.kernels.softmax import BACKENDS, Placement, attention
from lingua_zeco.sp.softmax import sp_softmax_attention
from lingua_zeco.sp import SPContext
from lingua_zeco.sp.varlen import Packing

SOFTMAX_BACKENDS = tuple(b for b in BACKENDS if b != "naive")  # naive: the float64 oracle, not a model choice


def softmax_layer_set(args: GLAArgs) -> frozenset[int]:
    """The validated model.softmax_layers (0-based block indices); one error naming every problem."""
    idx = list(args.softmax_layers or ())
    problems = []
    bad = [i for i in idx if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < args.n_layers]
    if bad:
        problems.append(f"indices {bad} are outside 0..{args.n_layers - 1} (model.n_layers={args.n_layers})")
    dup = sorted({i for i in idx if idx.count(i) > 1}, key=str)
    if dup:
        problems.append(f"indices {dup} appear more than once")
    if idx:
        if args.softmax_backend not in SOFTMAX_BACKENDS:
            problems.append(f"model.softmax_backend={args.softmax_backend!r}; choose from {SOFTMAX_BACKENDS}")
        if args.softmax_window is not None and args.softmax_window < 1:
            problems.append(f"model.softmax_window={args.softmax_window}: give null (full causal) or a window >= 1")
        if not args.rope_theta > 0:
            problems.append(f"model.rope_theta={args.rope_theta} must be > 0")
        if args.dim % args.n_heads or (args.dim // args.n_heads) % 2:
            problems.append(f"dim {args.dim} / n_heads {args.n_heads} must be an even integer (RoPE rotates pairs)")
    if problems:
        raise ValueError(f"model.softmax_layers={idx}: " + "; ".join(problems))
    return frozenset(idx)


def rope_positions(T_local: int, rank: int, packing, device) -> torch.Tensor:
    """[T_local] long: global positions of this rank's tokens, or offsets inside their documents."""
    if packing is None:
        return torch.arange(rank * T_local, (rank + 1) * T_local, device=device)
    return doc_offsets(packing.cu_seqlens, rank * T_local, T_local, device)


def rope_tables(pos_T: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """(cos, sin) [T, head_dim / 2] in `dtype` (fp32, or fp64 for an fp64 model): fla's inverse
    frequencies in fp32, the angles pos * inv_freq."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos_T.device, dtype=torch.float32) / head_dim))
    ang_TD = pos_T.to(dtype)[:, None] * inv.to(dtype)[None, :]
    return ang_TD.cos(), ang_TD.sin()


def apply_rope(x_BTHD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + D/2]) by the position's angles (GPT-NeoX layout, as fla)."""
    xf = x_BTHD.to(cos_TD.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos_TD[None, :, None, :], sin_TD[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x_BTHD.dtype)


class SoftmaxAttention(nn.Module):
    """o_proj(softmax attention(rope(q), rope(k), v)) over the whole global sequence; forward(x, cu_seqlens)
    like the linear-attention layers (cu_seqlens: None or the model's `Packing`)."""

    def __init__(self, args: GLAArgs, sp: SPContext):
        super().__init__()
        d, H = args.dim, args.n_heads
        self.n_heads, self.head_dim = H, d // H
        self.sp = sp
        self.window, self.backend, self.rope_theta = args.softmax_window, args.softmax_backend, args.rope_theta
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def _qkv(self, x, pos_T):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.n_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rope_tables(pos_T, self.head_dim, self.rope_theta, acc_dtype(x.dtype))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, packing):
        """The SP exchange (a separate method so that tests can swap in a broken one)."""
        return sp_softmax_attention(q, k, v, sp=self.sp, window=self.window, cu_seqlens=packing, backend=self.backend)

    def forward(self, x, cu_seqlens=None):
        B, T, _ = x.shape
        if cu_seqlens is not None and not isinstance(cu_seqlens, Packing):
            raise TypeError("SoftmaxAttention takes the model's Packing (lingua_zeco.sp.varlen.pack), "
                            "not raw cu_seqlens")
        rank = cu_seqlens.rank if cu_seqlens is not None else self.sp.rank_size[0]
        q, k, v = self._qkv(x, rope_positions(T, rank, cu_seqlens, x.device))
        o = self.attend(q, k, v, cu_seqlens)
        return self.o_proj(o.reshape(B, T, -1).to(x.dtype))

    @torch.no_grad()
    def forward_with_state(self, x, state=None):
        """Generation on one device: x [B, T, D] after the tokens cached in `state` = (k, v, n) (k rotated,
        [B, S, H, D]; n tokens seen so far; None = empty). Returns (output, new state); with a window
        the cache keeps only the keys a later query can still see."""
        B, T, _ = x.shape
        k_old, v_old, n = state if state is not None else (None, None, 0)
        q, k, v = self._qkv(x, torch.arange(n, n + T, device=x.device))
        if k_old is not None:
            k, v = torch.cat([k_old, k], 1), torch.cat([v_old, v], 1)
        o, _ = attention(q, k, v, Placement(q_start=n, k_start=n + T - k.shape[1], window=self.window), backend="sdpa")
        if self.window is not None:  # a query at position >= n + T sees keys after n + T - window
            k, v = k[:, max(0, k.shape[1] - (self.window - 1)):], v[:, max(0, v.shape[1] - (self.window - 1)):]
        return self.o_proj(o.reshape(B, T, -1).to(x.dtype)), (k, v, n + T)
