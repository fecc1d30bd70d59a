"""ZeCO on fla's kernel stages, with the All-Scan overlapped with the intra-chunk work (CUDA).

Forward on rank p (fla's chunk_gla_fwd, reordered; chunk size by fla's rule):
  1. g_cs = chunk-local cumsum of g (base 2, as fla keeps it)                    fla
  2. h, S_end = chunk states from a ZERO state            → S_end is ready early    fla
  3. Gx, b_end = gate sums from the slice start to each chunk (one small launch)  zeco_stages
  4. All-Scan(S_end, b_end) starts                                    ┐ overlapped
  5. A = intra-chunk attention (needs no state)                       ┘           fla
  6. o = output stage with S_in folded into each chunk's state in registers      zeco_stages
Backward: fla's backward with initial_state = S_in and final-state gradient G from the next rank.
G is not known at the start, so D = ∂L/∂S_in of this slice comes first:
  1. g_cs (fla); D = scale·Σ_t (q_t ⊙ b_t)ᵀ do_t (one read of q, g_cs, do)         zeco_stages
  2. reverse All-Scan of (D, b_end) → G starts                        ┐
  3. h recomputed from S_in; dA; intra-chunk dq, dk                    ┘ overlapped  fla
  4. dh with the final-state gradient G, then dv, and dq, dk, dg       (dg includes the decays of
     S_in and G: h carries S_in, dh carries G)                                    fla
The extra work against plain fla chunk_gla is the D pass, the chunk gate sums and the fold inside
the output stage: no pass rewrites the chunk states h or dh.
The side stream is used from `AllScanArgs.overlap_min_ranks` ranks on; below that (P = 2 by default,
one hop, where it measured slower) the scan runs on the caller's stream at the same points.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lingua_zeco.comm import AllScanArgs, ScanWork, all_scan, gather_scan
from lingua_zeco.kernels.zeco_stages import (chunk_decay_prefix, dS_in_reads_raw_gates, fla_chunk_size, zeco_dS_in,
                                             zeco_fwd_o)

from .fused_packed import FusedPackedZeCOGLA


class FusedZeCOGLA(torch.autograd.Function):
    """scan_fn(x, a, reverse) -> handle with wait(): the All-Scan over the SP group (injectable so that
    one GPU can run several virtual ranks in one process for tests and benchmarks)."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, scan_fn):
        from fla.ops.common.chunk_h import chunk_fwd_h
        from fla.ops.gla.chunk import chunk_gla_fwd_intra_gk
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum

        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        BT = fla_chunk_size(q.shape[1])
        g_cs = chunk_local_cumsum(g, BT, scale=RCP_LN2)
        h, S_end_BHKV = chunk_fwd_h(k=k, v=v, gk=g_cs, h0=None, output_final_state=True, chunk_size=BT)
        Gx_BNHK, b_end_BHK = chunk_decay_prefix(g_cs, BT)
        work = scan_fn(S_end_BHKV, b_end_BHK, False)
        A = chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cs, scale=scale, chunk_size=BT)
        S_in_BHKV = work.wait()
        o = zeco_fwd_o(q, v, g_cs, A, h, S_in_BHKV.to(h.dtype), Gx_BNHK, scale, BT)
        ctx.save_for_backward(q, k, v, g, A, S_in_BHKV, Gx_BNHK, b_end_BHK)
        ctx.scale, ctx.scan_fn, ctx.BT = scale, scan_fn, BT
        return o

    @staticmethod
    def backward(ctx, do):
        from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
        from fla.ops.gla.chunk import chunk_gla_bwd_dA, chunk_gla_bwd_dqk_intra, chunk_gla_bwd_dqkg, chunk_gla_bwd_dv
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum

        q, k, v, g, A, S_in_BHKV, Gx_BNHK, b_end_BHK = ctx.saved_tensors
        scale, BT = ctx.scale, ctx.BT
        do = do.contiguous()
        # D first, so the scan starts as early as possible: from 16-bit gates D makes its own cumsum
        g_cs = None if dS_in_reads_raw_gates(q, g) else chunk_local_cumsum(g, BT, scale=RCP_LN2)
        D_BHKV = zeco_dS_in(q, g_cs, Gx_BNHK, do, scale, BT, g=g)
        work = ctx.scan_fn(D_BHKV, b_end_BHK, True)
        if g_cs is None:
            g_cs = chunk_local_cumsum(g, BT, scale=RCP_LN2)
        h, _ = chunk_fwd_h(k=k, v=v, gk=g_cs, h0=S_in_BHKV, output_final_state=False, chunk_size=BT,
                           states_in_fp32=True)
        dA = chunk_gla_bwd_dA(v=v, do=do, scale=scale, chunk_size=BT)
        dq, dk = chunk_gla_bwd_dqk_intra(q=q, k=k, g=g_cs, dA=dA, chunk_size=BT)
        G_BHKV = work.wait()
        dh, _ = chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=None, dht=G_BHKV, scale=scale, gk=g_cs,
                             chunk_size=BT, states_in_fp32=True)
        dv = chunk_gla_bwd_dv(k=k, g=g_cs, A=A, do=do, dh=dh, chunk_size=BT)
        dq, dk, dg = chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=h, g=g_cs, do=do, dh=dh, dq=dq, dk=dk, scale=scale,
                                        chunk_size=BT)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g), None, None


def fused_zeco_gla(q, k, v, g, *, scale, group, seg, scan: AllScanArgs, gather: bool = False):
    """gather=False: ZeCO's All-Scan (overlapped). gather=True: LASP-2's all-gather + local scan on
    the same stages (blocking, as LASP-2 is; its cost is the P-state collective). Packed documents:
    a slice inside one document is the dense case; one where a document starts takes fused_packed."""

    def scan_fn(x, a, reverse):  # returns a handle; the caller computes until it waits
        if gather:
            return ScanWork(gather_scan(x, a, group, reverse=reverse))
        if dist.get_world_size(group) >= scan.overlap_min_ranks:
            return all_scan(x, a, group, reverse=reverse, args=scan, async_op=True)
        return ScanWork(all_scan(x, a, group, reverse=reverse, args=scan))

    return fused_zeco_apply(q, k, v, g, scale, scan_fn, seg)


def fused_zeco_apply(q, k, v, g, scale, scan_fn, seg):
    """The fused operator for this slice: dense (also a slice inside one packed document) or packed."""
    if seg.carries:
        return FusedZeCOGLA.apply(q, k, v, g, scale, scan_fn)
    return FusedPackedZeCOGLA.apply(q, k, v, g, scale, scan_fn, seg.cu_seqlens, seg.first_end)
