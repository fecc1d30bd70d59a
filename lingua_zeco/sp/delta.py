"""Sequence-parallel Gated DeltaNet: sp_gated_delta(q, k, v, g, beta, sp=SPContext(...)).

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
The scans are comm's (all_scan / gather_scan with transition=MATRIX), the same code as GLA's.
**Backward** of the scan (ScanFn, state_passing.py): with dY_p = ∂L/∂S_in(p) from the correction, the total
gradient E_p = ∂L/∂S_out(p) = ∂L/∂S_in(p+1) obeys E_{p−1} = dY_p + M_pᵀ E_p (E_{P−1} = 0): the
reverse exclusive scan of the pairs (M_pᵀ, dY_p). Then ∂L/∂S_loc(p) = E_p and ∂L/∂M_p = E_p S_in(p)ᵀ;
autograd through the kernel turns those into d k, v, g, β.

**Packed documents** (`cu_seqlens` of the whole packed sequence, B = 1, the same on every rank): the
identity block of the initial state goes to the local segment that continues the previous rank's
document only; every later segment starts from zeros, so its q̃ and, if it is the last, M are 0.
"""
from __future__ import annotations

import torch

from lingua_zeco import kernels
from lingua_zeco.comm import MATRIX
from lingua_zeco.kernels.delta import DeltaOptions, check_shapes

from .context import SPContext
from .graph import outside_graph
from .lasp1 import lasp1
from .state_passing import ScanFn
from .validate import check_across_ranks, check_local
from .varlen import LocalSegments, as_packing, local_segments


def _widened_pass(q_BTHK, k_BTHK, v_BTHV, gates, *, scale, seg: LocalSegments, opts: DeltaOptions):
    """One kernel call on [v | 0] from [0 | I]: (o_loc, q̃, S_loc, M), see the module docstring."""
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    v_wide = torch.cat([v_BTHV, v_BTHV.new_zeros(B, T, H, K)], dim=-1)
    N = B if seg.cu_seqlens is None else seg.n_segments
    acc = kernels.acc_dtype(q_BTHK.dtype)  # fp32 states (fp64 stays fp64: exactness checks)
    h0_NHKW = torch.zeros(N, H, K, V + K, dtype=acc, device=q_BTHK.device)  # W = V + K columns
    eye_KK = torch.eye(K, dtype=acc, device=q_BTHK.device)
    if seg.cu_seqlens is None:
        h0_NHKW[..., V:] = eye_KK
    elif seg.continues:  # only the segment that continues the previous rank's document sees S_in
        h0_NHKW[0, :, :, V:] = eye_KK
    o_BTHW, S_NHKW = opts.chunk_gated_delta(q_BTHK, k_BTHK, v_wide, gates, scale=scale, initial_state=h0_NHKW,
                                            output_final_state=True, cu_seqlens=seg.cu_seqlens)
    if seg.cu_seqlens is not None:
        S_NHKW = S_NHKW[-1:]  # the slice's end state is its last segment's
    S_BHKW = S_NHKW.to(acc)
    return o_BTHW[..., :V], o_BTHW[..., V:], S_BHKW[..., :V], S_BHKW[..., V:]


@outside_graph  # compiled blocks: the exchange and fla's kernels run outside the graph
def sp_gated_delta(q, k, v, g, beta, *, sp: SPContext | None = None, scale: float | None = None, cu_seqlens=None):
    """Gated delta rule on rank p's slice of a sequence split over sp.group; equals the single-device
    result on the concatenation. q, k [B, T_local, H, K] as the kernel uses them (the model L2-normalises
    them first: kernels.delta.l2norm); v [B, T_local, H, V]; g (log decay ≤ 0), beta [B, T_local, H].
    Reads sp.group, sp.method (zeco | lasp1 | lasp2 | none | local), sp.scan (zeco's All-Scan) and
    sp.gla.backend (the kernel's; sp.gla.save_h and sp.fused are GLA's). sp=None: SPContext()."""
    sp = SPContext() if sp is None else sp
    check_shapes(q, k, v, (g, beta), "sp_gated_delta")
    rank, P = sp.rank_size
    g_wide = g[..., None].expand_as(q)  # the shared checks know GLA's per-key gate shape
    packing = as_packing(cu_seqlens, rank=rank, P=P, T_local=q.shape[1], device=q.device)
    check_local(q, k, v, g_wide, sp.method, packing, P)
    if beta.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"sp_gated_delta: beta must be floating, got {beta.dtype}")
    check_across_ranks(q, v, g_wide, packing, sp.group, P)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    opts = DeltaOptions(backend=kernels.pick_backend(q.device, sp.gla.backend))
    if P == 1:
        cu = None if packing is None else packing.cu_seqlens
        return opts.chunk_gated_delta(q, k, v, (g, beta), scale=scale, cu_seqlens=cu)[0]
    seg = local_segments(None, rank, q.shape[1], q.device) if packing is None else packing.seg
    if sp.method == "local":  # diagnostic: every rank alone, S_in dropped (wrong on purpose)
        return opts.chunk_gated_delta(q, k, v, (g, beta), scale=scale, cu_seqlens=seg.cu_seqlens)[0]
    if sp.method == "lasp1":  # serial hand-over: no M needed, the slice simply runs from the received state
        def kernel(q, k, v, g, beta, **contract):  # lasp1 spreads the gates: each anchors its receive in the graph
            return opts.chunk_gated_delta(q, k, v, (g, beta), **contract)
        return lasp1(kernel, q, k, v, g, beta, scale=scale, group=sp.group, seg=seg)
    o_loc_BTHV, q_tilde_BTHK, S_loc_BHKV, M_BHKK = _widened_pass(q, k, v, (g, beta), scale=scale, seg=seg, opts=opts)
    acc = S_loc_BHKV.dtype  # fp32 (fp64 stays): exchange and correction in it even under autocast,
    with torch.autocast(q.device.type, enabled=False):  # which would run the products in bf16
        args = sp.scan if sp.method == "zeco" else None  # None: lasp2's all-gather
        S_in_BHKV = ScanFn.apply(S_loc_BHKV, M_BHKK, sp.group, args, MATRIX)
        o_BTHV = o_loc_BTHV.to(acc) + torch.einsum("bthk,bhkv->bthv", q_tilde_BTHK.to(acc), S_in_BHKV.to(acc))
        return o_BTHV.to(o_loc_BTHV.dtype)


__all__ = ["sp_gated_delta"]
