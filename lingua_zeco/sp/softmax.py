"""Sequence-parallel causal softmax attention: the softmax layers of a hybrid GLA model under SP.

Rank p of an SP group of P ranks holds global tokens [p·T_local, (p+1)·T_local) (ZeCO's slices); q and k
arrive rotated at their global positions. The result on rank p equals single-device causal attention
(optional sliding window, optional packed documents) on the concatenated sequence, forward and backward.

  allgather  Llama-3's context parallelism: all-gather K and V, attend the local queries to keys
             [0, (p+1)·T_local) (cut to the window / the first query's document); the gradients of the
             gathered K, V are reduce-scattered back to their owners (gloo: all-reduce, own slice).
  ring       K/V blocks travel p → p+1; each rank merges its partial results over the visiting blocks
             by their log-sum-exp, computing only blocks not wholly in the causal future / outside the
             window / in earlier documents; the next block is in flight while the current one is
             computed. The backward is a second ring in which dK/dV accumulators travel with their
             blocks (D = rowsum(do ⊙ o), dS = P ⊙ (dP − D)), in the accumulation dtype (fp32; fp64).
             Block compute uses the explicit-score path of lingua_zeco.kernels.softmax (it needs lse);
             `backend` applies to P = 1 and allgather.
The exchange is the SPContext's `softmax` (distributed.softmax_sp), over its `group`.
Contiguous slices load causal attention unevenly (the last rank computes the most): causal_work.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lingua_zeco.comm import global_rank, wait_all
from lingua_zeco.kernels.common import acc_dtype, doc_ids, doc_of
from lingua_zeco.kernels.softmax import Placement, attention, check_backend, explicit_backward, explicit_forward

from .context import SPContext
from .graph import outside_graph
from .varlen import Packing, as_packing

_TAG_KV, _TAG_DKV = 11, 12  # gloo matches messages by tag: keep the two rings of the backward apart


def check_inputs(q_BTHD, k_BTHD, v_BTHD, backend, window, cu_seqlens) -> None:
    where = "sp_softmax_attention"
    if any(not torch.is_tensor(t) or t.dim() != 4 for t in (q_BTHD, k_BTHD, v_BTHD)):
        raise ValueError(f"{where}: q, k, v must be [B, T_local, H, D] tensors")
    if k_BTHD.shape != q_BTHD.shape or v_BTHD.shape[:3] != q_BTHD.shape[:3]:
        raise ValueError(f"{where}: q, k must share [B, T_local, H, D] and v [B, T_local, H, Dv]; got q "
                         f"{tuple(q_BTHD.shape)}, k {tuple(k_BTHD.shape)}, v {tuple(v_BTHD.shape)}")
    if not (q_BTHD.dtype == k_BTHD.dtype == v_BTHD.dtype) or not q_BTHD.is_floating_point():
        raise ValueError(f"{where}: q, k, v must share one floating dtype; got {q_BTHD.dtype}, {k_BTHD.dtype}, "
                         f"{v_BTHD.dtype}")
    check_backend(backend, where)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: window must be None or an int ≥ 1 (a query at i sees keys i−window < j ≤ i); "
                         f"got {window!r}")
    if cu_seqlens is not None and q_BTHD.shape[0] != 1:
        raise ValueError(f"{where}: cu_seqlens (packed documents) requires B = 1, got B = {q_BTHD.shape[0]}")


@outside_graph  # compiled blocks: the exchange and fla's kernels run outside the graph
def sp_softmax_attention(q_BTHD, k_BTHD, v_BTHD, *, sp: SPContext | None = None, window: int | None = None,
                         cu_seqlens=None, backend: str = "auto", scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention of this rank's slice of sp.group, exchanged by sp.softmax (allgather | ring;
    sp=None: SPContext()). q, k [B, T_local, H, D], v [B, T_local, H, Dv], rotated at their global positions.
    cu_seqlens: None, a `Packing` (lingua_zeco.sp.varlen.pack) or the global boundaries 0 … P·T_local
    (tensor or ints; B = 1). Returns o [B, T_local, H, Dv]."""
    sp = SPContext() if sp is None else sp
    check_inputs(q_BTHD, k_BTHD, v_BTHD, backend, window, cu_seqlens)
    rank, P = sp.rank_size
    T = q_BTHD.shape[1]
    packing = as_packing(cu_seqlens, rank=rank, P=P, T_local=T, device=q_BTHD.device)
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    ring = Ring(sp.group, rank, P, T, scale, window, packing)
    if P == 1:
        o, _ = attention(q_BTHD, k_BTHD, v_BTHD, ring.place(0, q_BTHD.device), scale=scale, backend=backend)
        return o.to(q_BTHD.dtype)
    if sp.softmax == "allgather":
        return allgather_attention(q_BTHD, k_BTHD, v_BTHD, ring, backend)
    return RingAttention.apply(q_BTHD, k_BTHD, v_BTHD, ring)


@dataclass(eq=False)
class Ring:
    """Where this rank sits and what it may see: host-side facts, decided without touching the device."""
    group: object
    rank: int
    P: int
    T_local: int
    scale: float
    window: int | None
    packing: Packing | None

    def doc_ids(self, block: int, device) -> torch.Tensor | None:
        if self.packing is None:
            return None
        return doc_ids(self.packing.cu_seqlens, block * self.T_local, self.T_local, device)

    def place(self, block: int, device) -> Placement:
        """This rank's queries against rank `block`'s slice of keys."""
        return Placement(self.rank * self.T_local, block * self.T_local, self.window, self.doc_ids(self.rank, device),
                         self.doc_ids(block, device))

    def first_key(self) -> int:
        """The earliest key any of this rank's queries sees (window, the first query's document)."""
        start = self.rank * self.T_local
        lo = 0 if self.window is None else max(0, start - self.window + 1)
        if self.packing is not None:
            bounds = self.packing.boundaries
            lo = max(lo, bounds[doc_of(bounds, start)])
        return lo

    def sees(self, block: int) -> bool:
        """Whether some query of this rank sees some key of rank `block`'s slice."""
        last_key = (block + 1) * self.T_local - 1
        return block <= self.rank and last_key >= self.first_key()

    def peer(self, shift: int) -> int:
        return global_rank(self.group, (self.rank + shift) % self.P)


# ----------------------------------------------------------------------------- allgather

def _is_nccl(group, t: torch.Tensor) -> bool:
    return t.is_cuda and "nccl" in str(dist.get_backend(group))


class GatherSlices(torch.autograd.Function):
    """x [B, T, ...] on every rank → [P, B, T, ...]; backward: each rank gets the sum over ranks of the
    gradients of its own slice (reduce-scatter on NCCL; all-reduce and the own slice where gloo lacks it)."""

    @staticmethod
    def forward(ctx, x, group, rank, P):
        ctx.group, ctx.rank = group, rank
        x = x.contiguous()
        out = x.new_empty(P, *x.shape)
        if _is_nccl(group, x):
            dist.all_gather_into_tensor(out, x, group=group)
        else:
            dist.all_gather(list(out.unbind(0)), x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if _is_nccl(ctx.group, grad):
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None, None, None
        grad = grad.clone()  # all_reduce works in place: leave autograd's buffer alone
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


def allgather_attention(q_BTHD, k_BTHD, v_BTHD, ring: Ring, backend: str) -> torch.Tensor:
    B, T, H, D = q_BTHD.shape
    kv_PBTHC = GatherSlices.apply(torch.cat([k_BTHD, v_BTHD], -1), ring.group, ring.rank, ring.P)
    end = (ring.rank + 1) * T
    kv_BSHC = kv_PBTHC[:ring.rank + 1].permute(1, 0, 2, 3, 4).reshape(B, end, H, -1)
    lo = ring.first_key()  # keys before it are invisible to every local query: not computed
    kv_BSHC = kv_BSHC[:, lo:]
    doc_k_S = None if ring.packing is None else doc_ids(ring.packing.cu_seqlens, lo, end - lo, q_BTHD.device)
    place = Placement(ring.rank * T, lo, ring.window, ring.doc_ids(ring.rank, q_BTHD.device), doc_k_S)
    o, _ = attention(q_BTHD, kv_BSHC[..., :D], kv_BSHC[..., D:], place, scale=ring.scale, backend=backend)
    return o.to(q_BTHD.dtype)


# ----------------------------------------------------------------------------- ring

def _shift(t: torch.Tensor, ring: Ring, tag: int):
    """Send t to the next rank and receive the previous rank's tensor of the same shape; returns
    (receive buffer, works) without waiting, so the caller computes meanwhile."""
    recv = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, ring.peer(+1), ring.group, tag),
           dist.P2POp(dist.irecv, recv, ring.peer(-1), ring.group, tag)]
    return recv, dist.batch_isend_irecv(ops)


def _visiting_blocks(kv_BTHC, ring: Ring):
    """(step, src, K/V block of rank src) for the P steps of the ring: the next block is sent on before
    the caller computes on this one and waited for after, so it travels meanwhile."""
    for step in range(ring.P):
        if step < ring.P - 1:
            kv_next_BTHC, works = _shift(kv_BTHC, ring, _TAG_KV)
        yield step, (ring.rank - step) % ring.P, kv_BTHC
        if step < ring.P - 1:
            wait_all(works)
            kv_BTHC = kv_next_BTHC


def merge(o_BTHD, lse_BHT, o_blk_BTHD, lse_blk_BHT):
    """Combine two partial softmax results over disjoint key sets by their log-sum-exp. Rows empty in
    both stay o = 0, lse = −inf (exp(−inf − (−inf)) is NaN: zeroed)."""
    lse_new_BHT = torch.logaddexp(lse_BHT, lse_blk_BHT)
    w_BTH1 = torch.exp(lse_BHT - lse_new_BHT).nan_to_num(0.0).transpose(1, 2)[..., None]
    w_blk_BTH1 = torch.exp(lse_blk_BHT - lse_new_BHT).nan_to_num(0.0).transpose(1, 2)[..., None]
    return o_BTHD * w_BTH1 + o_blk_BTHD * w_blk_BTH1, lse_new_BHT


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BTHD, k_BTHD, v_BTHD, ring: Ring):
        B, T, H, D = q_BTHD.shape
        acc = acc_dtype(q_BTHD.dtype)
        o_BTHD = q_BTHD.new_zeros(B, T, H, v_BTHD.shape[-1], dtype=acc)
        lse_BHT = q_BTHD.new_full((B, H, T), float("-inf"), dtype=acc)
        for _, src, kv_BTHC in _visiting_blocks(torch.cat([k_BTHD, v_BTHD], -1).contiguous(), ring):
            if ring.sees(src):
                o_blk_BTHD, lse_blk_BHT = explicit_forward(q_BTHD, kv_BTHC[..., :D], kv_BTHC[..., D:],
                                                           ring.place(src, q_BTHD.device), scale=ring.scale)
                o_BTHD, lse_BHT = merge(o_BTHD, lse_BHT, o_blk_BTHD, lse_blk_BHT)
        ctx.ring = ring
        # o stays in the accumulation dtype: D = rowsum(do ⊙ o) of the backward is taken from it
        ctx.save_for_backward(q_BTHD, k_BTHD, v_BTHD, o_BTHD, lse_BHT)
        return o_BTHD.to(q_BTHD.dtype)

    @staticmethod
    def backward(ctx, do_BTHD):
        q_BTHD, k_BTHD, v_BTHD, o_BTHD, lse_BHT = ctx.saved_tensors
        ring = ctx.ring
        B, T, H, D = q_BTHD.shape
        do_BTHD = do_BTHD.to(o_BTHD.dtype)
        stats = lse_BHT, (do_BTHD * o_BTHD).sum(-1).transpose(1, 2)  # (lse, D = rowsum(do ⊙ o))
        dq_BTHD = torch.zeros_like(q_BTHD, dtype=o_BTHD.dtype)
        dkv_in_BTHC = dkv_works = None  # set by step 0 (there is always one), read from step 1 on and after the loop
        for step, src, kv_BTHC in _visiting_blocks(torch.cat([k_BTHD, v_BTHD], -1).contiguous(), ring):
            dkv_blk_BTHC = None
            if ring.sees(src):
                dq_blk_BTHD, dk_blk_BTHD, dv_blk_BTHD = explicit_backward(
                    do_BTHD, q_BTHD, kv_BTHC[..., :D], kv_BTHC[..., D:], stats, ring.place(src, q_BTHD.device),
                    scale=ring.scale)
                dq_BTHD += dq_blk_BTHD
                dkv_blk_BTHC = torch.cat([dk_blk_BTHD, dv_blk_BTHD], -1)
            # block src's accumulator arrives from the rank that held the block last step (its own share
            # was computed first, while the accumulator was in flight), gains ours, and moves on with it
            if step == 0:
                dkv_BTHC = (kv_BTHC.new_zeros(kv_BTHC.shape, dtype=o_BTHD.dtype) if dkv_blk_BTHC is None
                            else dkv_blk_BTHC)
            else:
                wait_all(dkv_works)
                dkv_BTHC = dkv_in_BTHC if dkv_blk_BTHC is None else dkv_in_BTHC + dkv_blk_BTHC
            dkv_in_BTHC, dkv_works = _shift(dkv_BTHC.contiguous(), ring, _TAG_DKV)  # last step: home to its owner
        wait_all(dkv_works)
        return (dq_BTHD.to(q_BTHD.dtype), dkv_in_BTHC[..., :D].to(k_BTHD.dtype),
                dkv_in_BTHC[..., D:].to(v_BTHD.dtype), None)


# ----------------------------------------------------------------------------- load balance

def _pairs_before(n: int, window: int | None) -> int:
    """Σ_{i<n} (keys query i sees) = Σ_{i<n} min(i + 1, window): visible (query, key) pairs of tokens [0, n)."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def causal_work(P: int, T_local: int, window: int | None = None) -> list[float]:
    """Each rank's share of the visible (query, key) score pairs of one sequence of P·T_local tokens cut
    into contiguous slices (sums to 1; 1/P would be balanced). Without a window rank p does ≈ (2p+1)/P²
    (long slices): the last rank ≈ (2P−1)/P², almost twice the mean. A window ≤ T_local evens it out beyond rank 0."""
    total = _pairs_before(P * T_local, window)
    return [(_pairs_before((p + 1) * T_local, window) - _pairs_before(p * T_local, window)) / total
            for p in range(P)]


__all__ = ["causal_work", "sp_softmax_attention"]
