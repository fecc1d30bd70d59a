"""Sequence-parallel Gated DeltaNet: sp_gated_delta(q, k, v, g, beta, group=..., method=...).

The gated delta rule's transition exp(g_t)(I − β_t k_t k_tᵀ) is a K×K matrix, so the state that
leaves rank p's slice is affine in the state that enters it:

    S_out(p) = M_p S_in(p) + S_loc(p),    M_p = Π_t exp(g_t)(I − β_t k_t k_tᵀ)  (later tokens on the left)

and inside the slice S_t = M_t S_in + S_t^loc (M_t: the product up to token t), hence

    o_t = o_t^loc + S_inᵀ q̃_t,    q̃_t = scale · M_tᵀ q_t.

**One widened kernel pass.** The recurrence acts on the columns of S independently. Running the
rank's tokens with v' = [v | 0_K] and initial state [0_{K×V} | I_K] therefore returns, in one call,
o' = [o^loc | q̃] and final state [S_loc | M]. (The "three passes" design — local pass, M pass with
v = 0 and h0 = I, final pass from S_in — does the same work and more: the first two share k, g, β
and become the two column blocks of one call; the third is replaced by the correction S_inᵀ q̃,
an O(T·K·V) product, because the output is linear in the initial state too.)

**Scan over ranks.** S_in(0) = 0, S_in(p+1) = M_p S_in(p) + S_loc(p): the exclusive scan of the
pairs (M, S) under the associative combine (M₂, S₂)∘(M₁, S₁) = (M₂M₁, M₂S₁ + S₂) (1 earlier).
* zeco, algorithm chain: rank p receives S_in(p), sends M_p S_in(p) + S_loc(p) on. M never leaves
  the rank: one K×V state per hop, as GLA's All-Scan, pipelined in blocks along V (the columns are
  independent; blocks along K, as GLA's chain uses, would not be, because M mixes rows).
* zeco, algorithm tree: Hillis–Steele over the pairs, ceil(log2 P) rounds of (K×K + K×V).
* lasp2: all-gather every rank's (M, S_loc), combine the earlier ones locally.
* lasp1: serial: wait for S_in, run the slice from it (plain width V), send S_out on. No M at all.
**Backward** of the scan (MatScanFn): with dY_p = ∂L/∂S_in(p) from the correction, the total
gradient E_p = ∂L/∂S_out(p) = ∂L/∂S_in(p+1) obeys E_{p−1} = dY_p + M_pᵀ E_p (E_{P−1} = 0): the
reverse exclusive scan of the pairs (M_pᵀ, dY_p). Then ∂L/∂S_loc(p) = E_p and ∂L/∂M_p = E_p S_in(p)ᵀ;
autograd through the kernel turns those into d k, v, g, β.

**Packed documents** (`cu_seqlens` of the whole packed sequence, B = 1, the same on every rank): the
identity block of the initial state goes to the local segment that continues the previous rank's
document only; every later segment starts from zeros, so its q̃ and, if it is the last, M are 0.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lingua_zeco import kernels
from lingua_zeco.comm import AllScanArgs
from lingua_zeco.comm.all_scan import (_k_blocks, best_n_blocks, chain_time, hillis_steele, pipelined_chain,
                                       tree_time)
from lingua_zeco.kernels.delta import check_shapes, chunk_gated_delta, l2norm

from .state_passing import RecvPrevFn, SendNextFn, _AllGatherFn, _global, group_rank_size
from .validate import check_across_ranks, check_local
from .varlen import LocalSegments, local_segments

SCAN_ALGORITHMS = ("chain", "tree", "auto")


# ----------------------------------------------------------------------------- the scan (no autograd)

def _chain(x, A, group, pos, P, peer, n_blocks):
    """Matrix chain in blocks of V columns (A mixes rows, so blocks of rows would not be independent):
    forward A y + x."""
    slices = [(..., slice(s, e)) for s, e in _k_blocks(x.shape[-1], n_blocks)]
    return pipelined_chain(x, slices, lambda sl, y: x[sl] + A @ y, group, pos, P, peer)


def _tree(x, A, group, pos, P, peer):
    """Hillis–Steele over the pairs: (A₁, x₁) then (A₂, x₂) composes to (A₂A₁, A₂x₁ + x₂)."""
    def compose(earlier, later):
        (eA, ex), (lA, lx) = earlier, later
        return lA @ eA, lA @ ex + lx

    exc = hillis_steele((A, x), compose, group, pos, P, peer)
    return torch.zeros_like(x) if exc is None else exc[1]


def choose_scan(P: int, x: torch.Tensor, A: torch.Tensor, args: AllScanArgs) -> tuple[str, int]:
    """(algorithm, chain blocks) by the α–β model: the chain moves K×V a hop, the tree K×(K+V) a round."""
    if args.algorithm not in SCAN_ALGORITHMS:
        raise ValueError(f"sp_gated_delta: scan algorithm must be one of {SCAN_ALGORITHMS} (the hierarchical "
                         f"scan of GLA is not built for matrix transitions), got {args.algorithm!r}")
    nbytes = x.numel() * x.element_size()
    n = args.n_blocks or best_n_blocks(P, nbytes, args.alpha_s, args.beta_Bps)
    if args.algorithm != "auto":
        return args.algorithm, n
    rounds = math.ceil(math.log2(P)) if P > 1 else 0
    chain = chain_time(P, nbytes, n, args.alpha_s, args.beta_Bps)
    tree = tree_time(P, nbytes + A.numel() * A.element_size(), args.alpha_s, args.beta_Bps) + \
        rounds * args.tree_round_extra_s
    return ("tree" if tree < chain else "chain"), n


def pair_scan(x: torch.Tensor, A: torch.Tensor, group=None, reverse: bool = False,
              args: AllScanArgs | None = None) -> torch.Tensor:
    """Exclusive scan of x [..., K, V] with transitions A [..., K, K] over the ranks of `group`:

        y_p = Σ_{r<p} A_{p−1} ⋯ A_{r+1} x_r       (reverse=True: Σ_{r>p} A_{p+1} ⋯ A_{r−1} x_r)

    i.e. y_{p+1} = A_p y_p + x_p, y_0 = 0. fp32 advised; no autograd here (MatScanFn)."""
    if x.dim() < 2 or A.shape != (*x.shape[:-1], x.shape[-2]):
        raise ValueError(f"pair_scan: x must be [..., K, V] and A [..., K, K]; got {tuple(x.shape)}, {tuple(A.shape)}")
    args = args or AllScanArgs()
    group = group if group is not None else dist.group.WORLD
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    if P == 1:
        return torch.zeros_like(x)
    x, A = x.contiguous(), A.to(x.dtype).contiguous()
    pos = P - 1 - rank if reverse else rank

    def peer(p):
        return _global(group, P - 1 - p if reverse else p)

    algo, n_blocks = choose_scan(P, x, A, args)
    with torch.autocast(x.device.type, enabled=False):  # autocast would run A @ y in bf16 (and mix dtypes)
        if algo == "tree":
            return _tree(x, A, group, pos, P, peer)
        return _chain(x, A, group, pos, P, peer, n_blocks)


class MatScanFn(torch.autograd.Function):
    """S_in = pair_scan(S_loc, M). Backward: E = reverse pair_scan(dS_in, Mᵀ) is ∂L/∂S_out of this
    rank, so ∂L/∂S_loc = E and ∂L/∂M = E S_inᵀ."""

    @staticmethod
    def forward(ctx, S_loc, M, group, args: AllScanArgs):
        S_in = pair_scan(S_loc, M, group, args=args)
        ctx.save_for_backward(M, S_in)
        ctx.group, ctx.args = group, args
        return S_in

    @staticmethod
    def backward(ctx, dS_in):
        M, S_in = ctx.saved_tensors
        E = pair_scan(dS_in.to(M.dtype).contiguous(), M.transpose(-1, -2), ctx.group, reverse=True, args=ctx.args)
        with torch.autocast(E.device.type, enabled=False):
            return E, E @ S_in.transpose(-1, -2), None, None


def gather_pair_scan(S_loc, M, group):
    """LASP-2 style: all-gather every rank's (M, S_loc); combine those of the earlier ranks locally.
    Differentiable through _AllGatherFn (its backward reduces the gradients of the stacks)."""
    rank, _ = group_rank_size(group)
    Ss, Ms = _AllGatherFn.apply(S_loc, group), _AllGatherFn.apply(M, group)
    y = 0 * (Ms[0] @ Ss[0])  # keeps both gathers in every rank's graph (their backward is a collective)
    for r in range(rank):
        y = Ms[r] @ y + Ss[r]
    return y


# ----------------------------------------------------------------------------- the operator

def _widened_pass(q, k, v, g, beta, *, scale, seg: LocalSegments, backend):
    """One kernel call on [v | 0] from [0 | I]: (o_loc, q̃, S_loc, M), see the module docstring."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    v_wide = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    N = B if seg.cu_seqlens is None else seg.n_segments
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 states (fp64 stays fp64: exactness checks)
    h0 = torch.zeros(N, H, K, V + K, dtype=acc, device=q.device)
    eye = torch.eye(K, dtype=acc, device=q.device)
    if seg.cu_seqlens is None:
        h0[..., V:] = eye
    elif seg.continues:  # only the segment that continues the previous rank's document sees S_in
        h0[0, :, :, V:] = eye
    o_wide, S_wide = chunk_gated_delta(q, k, v_wide, g, beta, scale=scale, initial_state=h0,
                                       output_final_state=True, cu_seqlens=seg.cu_seqlens, backend=backend)
    if seg.cu_seqlens is not None:
        S_wide = S_wide[-1:]  # the slice's end state is its last segment's
    S_wide = S_wide.to(acc)
    return o_wide[..., :V], o_wide[..., V:], S_wide[..., :V], S_wide[..., V:]


def sp_gated_delta(q, k, v, g, beta, *, group=None, method: str = "zeco", scale: float | None = None,
                   cu_seqlens=None, use_qk_l2norm: bool = False, backend: str | None = None,
                   scan: AllScanArgs | None = None, drop_transition: bool = False):
    """Gated delta rule on rank p's slice of a sequence split over `group`; equals the single-device
    result on the concatenation. q, k [B, T_local, H, K]; v [B, T_local, H, V]; g (log decay ≤ 0),
    beta [B, T_local, H]. use_qk_l2norm: normalise q and k first (fla's use_qk_l2norm_in_kernel).
    scan.algorithm: chain | tree | auto (zeco only). drop_transition: a deliberately wrong variant
    for tests (the combine forgets M: S_in(p+1) = S_loc(p)); never use it otherwise."""
    check_shapes(q, k, v, g, beta, "sp_gated_delta")
    rank, P = group_rank_size(group)
    g_wide = g[..., None].expand_as(q)  # the shared checks know GLA's per-key gate shape
    check_local(q, k, v, g_wide, method, cu_seqlens, P)
    if beta.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"sp_gated_delta: beta must be floating, got {beta.dtype}")
    check_across_ranks(q, v, g_wide, cu_seqlens, group, P)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    name = kernels.pick_backend(q.device, backend)
    if P == 1:
        return chunk_gated_delta(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, backend=name)[0]
    seg = local_segments(cu_seqlens, rank, q.shape[1], q.device)
    if method == "local":  # diagnostic: every rank alone, S_in dropped (wrong on purpose)
        return chunk_gated_delta(q, k, v, g, beta, scale=scale, cu_seqlens=seg.cu_seqlens, backend=name)[0]
    if method == "lasp1":
        return _lasp1(q, k, v, g, beta, scale=scale, group=group, seg=seg, backend=name)
    o_loc, q_tilde, S_loc, M = _widened_pass(q, k, v, g, beta, scale=scale, seg=seg, backend=name)
    if drop_transition:
        M = torch.zeros_like(M)
    acc = S_loc.dtype  # fp32 (fp64 stays): exchange and correction in it even under autocast,
    with torch.autocast(q.device.type, enabled=False):  # which would run the products in bf16
        if method == "lasp2":
            S_in = gather_pair_scan(S_loc, M, group)
        else:
            S_in = MatScanFn.apply(S_loc, M, group, scan or AllScanArgs())
        o = o_loc.to(acc) + torch.einsum("bthk,bhkv->bthv", q_tilde.to(acc), S_in.to(acc))
        return o.to(o_loc.dtype)


def _lasp1(q, k, v, g, beta, *, scale, group, seg: LocalSegments, backend):
    """Serial hand-over: no M is needed, the slice simply runs from the received state."""
    B, _, H, K = q.shape
    S_in = RecvPrevFn.apply((B, H, K, v.shape[-1]), group, q, k, v, g, beta)
    h0 = S_in
    if seg.cu_seqlens is not None:
        first = S_in if seg.continues else S_in * 0  # keep S_in in the graph: its backward must send
        h0 = torch.cat([first, first.new_zeros(seg.n_segments - 1, *first.shape[1:])])
    o, S_out = chunk_gated_delta(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                 cu_seqlens=seg.cu_seqlens, backend=backend)
    S_out = S_out[-1:] if seg.cu_seqlens is not None else S_out
    return SendNextFn.apply(o, S_out, group)


__all__ = ["MatScanFn", "SCAN_ALGORITHMS", "gather_pair_scan", "pair_scan", "sp_gated_delta"]
