"""Segment-recurrent training: a sequence of any length, trained segment by segment with exact gradients.

With model.segment_len = s, each rank's T_local tokens are n = ceil(T_local / s) segments; segment j is the
group's global tokens [j·s·P, j·s·P + P·s_j) (s_j = s, the last one shorter), rank p holding its p-th
piece (the loaders' segment-major layout, `sp_pieces`). One step (`forward_backward`):
  1. forward segments 0 … n-2 without autograd and keep only what each hands on: every linear-attention
     layer's state [B, H, K, V] (fp32) at each boundary;
  2. for j = n-1 … 0: forward segment j with autograd from its stored states, backward its loss together
     with the gradient that arrived at its final states from segment j+1, and keep the gradient of its
     incoming states for segment j-1.
Compute: one extra forward without autograd (as full activation checkpointing); memory: one segment's
activations plus the boundary states, whatever the sequence length. Packed documents: a document that runs
into the next segment keeps its state, a document starting at a segment's first token resets it.
The layers' part is lingua_zeco.sp.sp_gla_carry; the model takes `carry=` and `head=` (apps/gla/model.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lingua_zeco.sp import StateCarry


SEGMENT_GRADS = ("exact", "truncated")  # model.segment_grad


@dataclass(frozen=True)
class Segment:
    index: int
    start: int          # first local token of this rank's piece
    end: int            # one past its last
    global_start: int   # the segment's first token in the group's sequence
    global_len: int     # the group's tokens in this segment: P · (end - start)

    def piece_start(self, sp_rank: int) -> int:
        """Global position of rank sp_rank's first token in this segment."""
        return self.global_start + sp_rank * (self.end - self.start)


def plan(T_local: int, segment_len: int, P: int = 1) -> list[Segment]:
    """The segments of a rank's T_local tokens (segment_len 0: one segment, the whole sequence)."""
    s = segment_len if 0 < segment_len < T_local else T_local
    return [Segment(j, a, min(a + s, T_local), a * P, P * (min(a + s, T_local) - a))
            for j, a in enumerate(range(0, T_local, s))]


def sp_pieces(sp_rank: int, sp_size: int, seq_len: int, segment_len: int) -> list[tuple[int, int]]:
    """The global token ranges [a, b) rank sp_rank holds, in its local order: one slice without segments
    (or with one rank), else its piece of every segment (the data loaders slice sequences by this)."""
    return [(seg.piece_start(sp_rank), seg.piece_start(sp_rank) + seg.end - seg.start)
            for seg in plan(seq_len, segment_len if sp_size > 1 else 0, sp_size)]


def _host_bounds(cu_seqlens) -> tuple[int, ...] | None:
    """The packed boundaries of the whole sequence on the host, once per micro-batch (host ints from the loader)."""
    if cu_seqlens is None:
        return None
    return tuple(cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)


def _boundaries(bounds: tuple[int, ...] | None, seg: Segment):
    """(the segment's own packed boundaries or None, whether its first document continues from before)."""
    if bounds is None:
        return None, seg.index > 0
    a, b = seg.global_start, seg.global_start + seg.global_len
    inside = sorted({c - a for c in bounds if a < c < b})
    return [0, *inside, seg.global_len], seg.index > 0 and a not in bounds


def _piece(t: torch.Tensor | None, seg: Segment):
    return None if t is None else t[:, seg.start:seg.end]


def forward_segments(model, input_ids, labels, cu_seqlens, segments: list[Segment], head: bool = True,
                     autocast=None, carry: bool = True):
    """Forward the segments in order without autograd, each from the states the previous one handed on.
    Yields (segment, its StateCarry: states_in and, after the forward, states_out, the model's output: (loss
    sum, tokens) with labels, None with head=False). carry=False: one segment, the whole sequence, through
    the model's plain call (any model; compiled blocks stay compiled)."""
    states, bounds = {}, _host_bounds(cu_seqlens)
    for seg in segments:
        cu, continues = _boundaries(bounds, seg)
        state = StateCarry(states, continues) if carry else None
        ids, lab = _piece(input_ids, seg), _piece(labels, seg)
        with torch.no_grad(), autocast or contextlib.nullcontext():
            out = (model(ids, labels=lab, cu_seqlens=cu, carry=state, head=head) if carry
                   else model(ids, labels=lab, cu_seqlens=cu))
        yield seg, state, out
        states = state.states_out if carry else {}


def forward_backward(model, input_ids, labels, cu_seqlens, segment_len: int, P: int, loss_scale,
                     set_sync=None, autocast=None, grad: str = "exact") -> torch.Tensor:
    """One micro-batch segment by segment (module doc). The gradient is that of loss_scale × (sum of token
    losses), as one backward over the whole sequence would give. set_sync(flag) (FSDP2's
    set_requires_gradient_sync): called with True before the last backward only, so gradients are reduced
    once. autocast: the context the forwards run in (the trainer's bf16 autocast on CUDA).
    grad="truncated": truncated backpropagation through time instead: the segments in order, each forward
    and backward at once from the states of the one before, no gradient handed back across a boundary
    (no extra forward; what the exact schedule is tested against). Returns the sum of token losses."""
    if grad not in SEGMENT_GRADS:
        raise ValueError(f"model.segment_grad={grad!r}; choose from {SEGMENT_GRADS}")
    segments, exact = plan(input_ids.shape[1], segment_len, P), grad == "exact"
    stored, states = [], {}  # exact: every segment's incoming states; truncated: the last segment's outgoing
    if exact:
        for _, carry, _ in forward_segments(model, input_ids, None, cu_seqlens, segments[:-1], head=False,
                                            autocast=autocast):
            stored.append(carry.states_in)
            states = carry.states_out
        stored.append(states)
    order = list(reversed(segments)) if exact else segments
    loss_sum = torch.zeros((), dtype=torch.float64, device=input_ids.device)
    grads, bounds = {}, _host_bounds(cu_seqlens)
    for seg in order:
        cu, continues = _boundaries(bounds, seg)
        leaves = {i: s.detach().requires_grad_(continues and exact)
                  for i, s in (stored[seg.index] if exact else states).items()}
        carry = StateCarry(leaves, continues)
        if set_sync is not None:
            set_sync(seg is order[-1])
        with autocast or contextlib.nullcontext():
            tok_loss, _ = model(_piece(input_ids, seg), labels=_piece(labels, seg), cu_seqlens=cu, carry=carry)
        outs, outs_grad = [tok_loss * loss_scale.to(tok_loss.dtype)], [None]
        for i, g in grads.items():
            if i in carry.states_out:
                outs.append(carry.states_out[i])
                outs_grad.append(g)
        torch.autograd.backward(outs, outs_grad)
        grads = {i: s.grad for i, s in leaves.items() if s.grad is not None}
        if not exact:  # truncated: the next segment starts from these, without their graph
            states = {i: s.detach() for i, s in carry.states_out.items()}
        loss_sum += tok_loss.detach().to(torch.float64)
    return loss_sum
