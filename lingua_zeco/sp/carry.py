"""GLA that starts from a carried state and hands its final state on: one segment of a sequence trained
segment by segment (lingua_zeco/segments.py), on one rank or spread over an SP group.

`StateCarry` travels with one segment's forward through every layer: layer i reads `state_in(i)` (None: the
zero state) and writes its final state with `put(i, S)`. `lingua_zeco.sp.sp_gla_carry(q, k, v, g, S0, ...) ->
(o, S_end)` (in gla.py, beside sp_gla, which it calls) runs:

* one rank: the kernel's own initial and final state (our staged operator on CUDA, the torch chunked kernel
  elsewhere), autograd through both;
* an SP group: the configured method (ZeCO, LASP-1, LASP-2) on the zero-state problem, plus the carried
  state's exact contribution. GLA is linear in its initial state, so with G_t = Σ_{u≤t} g_u over the whole
  segment (every rank's tokens in order):
      o_t  += scale · (q_t ⊙ exp(G_t))ᵀ S0                        tokens of the segment's first document
      S_end = Σ_t (k_t ⊙ exp(G_T − G_t)) v_tᵀ + exp(G_T) ⊙ S0      tokens of its last document (S0 if one)
  The sum over tokens is an all-reduce over the group, so every rank holds S_end (and S0). Each rank's
  gradient of S0 is its own tokens' part: the parts sum to the true gradient, and the all-reduce's backward
  (a sum) gives every rank the whole gradient of its partial sum, so the schedule hands on per-rank parts.
  Cost per layer: two [K, T] × [T, V] products per head and one all-reduce of a state each way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from lingua_zeco import kernels
from lingua_zeco.kernels.common import doc_ids, doc_of

from .context import SPContext


class StateCarry:
    """The recurrent states of every linear-attention layer across one segment boundary.
    states_in[i]: layer i's incoming state [B, H, K, V] (absent: zeros); continues=False: the segment starts
    a new document, so no layer reads its incoming state (the reset at a document boundary).
    A plain class, not a dataclass: FSDP2 rebuilds dataclasses and dicts found in a module's arguments (to
    cast their tensors), and the layers must write into this very object."""

    def __init__(self, states_in: dict, continues: bool = True):
        self.states_in, self.continues = states_in, continues
        self.states_out = {}

    def state_in(self, layer: int):
        return self.states_in.get(layer) if self.continues else None

    def put(self, layer: int, state: torch.Tensor) -> None:
        # activation checkpointing recomputes the layer in the backward: the state of the first forward is
        # the one the schedule differentiates, so a recomputed copy is not kept
        self.states_out.setdefault(layer, state)


def one_rank_carry(qkvg, S0, packing, scale, options: kernels.GLAOptions):
    """sp_gla_carry on a group of one rank: the kernel's own initial and final state. qkvg = (q, k, v, g)."""
    q, k, v, g = qkvg
    seg, h0 = None, S0
    if packing is not None:
        seg = packing.seg
        if S0 is not None and seg.n_segments > 1:  # documents after the first start from zero
            h0 = torch.cat([S0, S0.new_zeros((seg.n_segments - 1, *S0.shape[1:]))])
    run = options.chunk_simple_gla if g.dim() == 3 else options.chunk_gla  # simple GLA: one decay per head
    o, ht = run(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=seg)
    return o, ht[-1:] if packing is not None else ht


def add_carried(qkvg, S0, o, packing, scale, sp: SPContext):
    """sp_gla_carry on P > 1 ranks from the zero-state output o: o plus S0's contribution, and the segment's
    final state (module doc). qkvg = (q, k, v, g), g [B, T_local, H, K] (a simple GLA gate broadcast over K)."""
    q, k, v, g = qkvg
    group, (rank, P) = sp.group, sp.rank_size
    B, T, H, K = q.shape
    acc = kernels.acc_dtype(q.dtype, g.dtype, *(() if S0 is None else (S0.dtype,)))
    with torch.autocast(q.device.type, enabled=False):
        G_BTHK = g.to(acc).cumsum(1)
        # every rank's gate total at its slot, summed over the group: the totals of all ranks, differentiably
        totals_PBHK = G_BTHK.new_zeros((P, B, H, K)).index_copy(0, torch.tensor([rank], device=q.device),
                                                                 G_BTHK[:, -1][None])
        totals_PBHK = dist_nn.all_reduce(totals_PBHK, op=dist.ReduceOp.SUM, group=group)
        G_BTHK = G_BTHK + totals_PBHK[:rank].sum(0)[:, None]
        G_T_BHK = totals_PBHK.sum(0)
        first_T, last_T, whole = _document_masks(packing, rank, T, q.device, acc)
        k_BTHK = k.to(acc) * (G_T_BHK[:, None] - G_BTHK).exp()
        if last_T is not None:
            k_BTHK = k_BTHK * last_T[None, :, None, None]
        S_BHKV = dist_nn.all_reduce(torch.einsum("bthk,bthv->bhkv", k_BTHK, v.to(acc)), op=dist.ReduceOp.SUM,
                                    group=group)
        if S0 is None:
            return o, S_BHKV
        q_BTHK = q.to(acc) * G_BTHK.exp()
        if first_T is not None:
            q_BTHK = q_BTHK * first_T[None, :, None, None]
        o = o + (scale * torch.einsum("bthk,bhkv->bthv", q_BTHK, S0.to(acc))).to(o.dtype)
        if whole:
            S_BHKV = S_BHKV + G_T_BHK.exp()[..., None] * S0.to(acc)
    return o, S_BHKV


def _document_masks(packing, rank: int, T: int, device, dtype):
    """(tokens of the segment's first document, of its last document, whether they are one document): the
    masks None for one dense sequence."""
    if packing is None:
        return None, None, True
    bounds = packing.boundaries
    first, last = doc_of(bounds, 0), doc_of(bounds, bounds[-1] - 1)
    ids_T = doc_ids(packing.cu_seqlens, rank * T, T, device)
    return (ids_T == first).to(dtype), (ids_T == last).to(dtype), first == last
