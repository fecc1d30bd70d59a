"""ZeCO on fla's kernel stages, with the All-Scan overlapped with the intra-chunk work (CUDA).

Forward on rank p (fla's chunk_gla_fwd, reordered):
  1. g_cs = chunk-local cumsum of g (base 2, as fla keeps it)
  2. h, S_end = chunk states from a ZERO state              → S_end is ready early
  3. All-Scan(S_end, b_end) starts on a side stream          ┐ overlapped
  4. A = intra-chunk attention (needs no state)             ┘
  5. h_n += diag(2^{Gx_n}) S_in  (Gx_n: gate sum from the slice start to chunk n, base 2)
  6. o = fla's output stage from (A, h)
Backward: the same as fla's backward with initial_state = S_in and final-state gradient G from
the next rank, except that G is not known when dh is computed:
  1. h recomputed from S_in (as fla does);  dh, D = ∂L/∂S_in from a zero final gradient
  2. reverse All-Scan of (b_end, D) gives G on a side stream  ┐ overlapped
  3. dA and the intra-chunk dq, dk                             ┘
  4. dh_n += diag(2^{Gtot − Gi_n}) G   (Gi_n: gate sum through chunk n)
  5. dv, and dq, dk, dg from fla's inter-chunk stage (dg then includes the decay of S_in and of G).
The extra work against plain fla is the two folds and a few [B, NT, H, K] gate sums.
The side stream is used from `AllScanArgs.overlap_min_ranks` ranks on; below that (P = 2 by default,
one hop, where it measured slower) the scan runs on the caller's stream at the same points.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lingua_zeco.comm import AllScanArgs, ScanWork, all_scan, gather_scan
from lingua_zeco.kernels.fold import fold_state_


def _chunk_gate_sums(g_cs_BTHK, BT):
    """Base-2 gate sums at chunk ends: inclusive and exclusive over chunks, [B, NT, H, K] fp32."""
    T = g_cs_BTHK.shape[1]
    ends = torch.arange(BT - 1, T + BT - 1, BT, device=g_cs_BTHK.device).clamp_(max=T - 1)
    tot_BNHK = g_cs_BTHK[:, ends].float()
    # scan along the innermost dim: torch's outer-dim scan took ~47 µs here at NT = 256
    incl_BNHK = tot_BNHK.movedim(1, -1).cumsum(-1).movedim(-1, 1)
    return incl_BNHK, incl_BNHK - tot_BNHK


class FusedZeCOGLA(torch.autograd.Function):
    """scan_fn(x, a, reverse) -> handle with wait(): the All-Scan over the SP group (injectable so that
    a single GPU can run two virtual ranks in one process for tests)."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, scan_fn):
        from fla.ops.common.chunk_h import chunk_fwd_h
        from fla.ops.gla.chunk import chunk_gla_fwd_intra_gk, chunk_gla_fwd_o_gk
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum

        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        BT = 64
        g_cs = chunk_local_cumsum(g, BT, scale=RCP_LN2)
        h, S_end_BHKV = chunk_fwd_h(k=k, v=v, gk=g_cs, h0=None, output_final_state=True, chunk_size=BT)
        incl_BNHK, excl_BNHK = _chunk_gate_sums(g_cs, BT)
        b_end_BHK = torch.exp2(incl_BNHK[:, -1])
        work = scan_fn(S_end_BHKV, b_end_BHK, False)
        A = chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cs, scale=scale, chunk_size=BT)
        S_in_BHKV = work.wait()
        fold_state_(h, torch.exp2(excl_BNHK), S_in_BHKV)
        o = chunk_gla_fwd_o_gk(q=q, v=v, g=g_cs, A=A, h=h, scale=scale, chunk_size=BT)
        ctx.save_for_backward(q, k, v, g, A, S_in_BHKV)
        ctx.scale, ctx.scan_fn, ctx.BT = scale, scan_fn, BT
        return o

    @staticmethod
    def backward(ctx, do):
        from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
        from fla.ops.gla.chunk import chunk_gla_bwd_dA, chunk_gla_bwd_dqk_intra, chunk_gla_bwd_dqkg, chunk_gla_bwd_dv
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum

        q, k, v, g, A, S_in_BHKV = ctx.saved_tensors
        scale, BT = ctx.scale, ctx.BT
        do = do.contiguous()
        g_cs = chunk_local_cumsum(g, BT, scale=RCP_LN2)
        incl_BNHK, _ = _chunk_gate_sums(g_cs, BT)
        b_end_BHK = torch.exp2(incl_BNHK[:, -1])
        h, _ = chunk_fwd_h(k=k, v=v, gk=g_cs, h0=S_in_BHKV, output_final_state=False, chunk_size=BT,
                           states_in_fp32=True)
        dh, D_BHKV = chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=S_in_BHKV, dht=None, scale=scale, gk=g_cs,
                                  chunk_size=BT, states_in_fp32=True)
        work = ctx.scan_fn(D_BHKV, b_end_BHK, True)
        dA = chunk_gla_bwd_dA(v=v, do=do, scale=scale, chunk_size=BT)
        dq, dk = chunk_gla_bwd_dqk_intra(q=q, k=k, g=g_cs, dA=dA, chunk_size=BT)
        G_BHKV = work.wait()
        fold_state_(dh, torch.exp2(incl_BNHK[:, -1:] - incl_BNHK), G_BHKV)
        dv = chunk_gla_bwd_dv(k=k, g=g_cs, A=A, do=do, dh=dh, chunk_size=BT)
        dq, dk, dg = chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=h, g=g_cs, do=do, dh=dh, dq=dq, dk=dk, scale=scale,
                                        chunk_size=BT)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g), None, None


def fused_zeco_gla(q, k, v, g, *, scale, group, seg, scan: AllScanArgs, gather: bool = False):
    """gather=False: ZeCO's All-Scan (overlapped). gather=True: LASP-2's all-gather + local scan on
    the same stages (blocking, as LASP-2 is; its cost is the P-state collective)."""
    assert seg.cu_seqlens is None, "the fused path takes equal-length sequences; packed ones go through compose"

    def scan_fn(x, a, reverse):  # returns a handle; the caller computes until it waits
        if gather:
            return ScanWork(gather_scan(x, a, group, reverse=reverse))
        if dist.get_world_size(group) >= scan.overlap_min_ranks:
            return all_scan(x, a, group, reverse=reverse, args=scan, async_op=True)
        return ScanWork(all_scan(x, a, group, reverse=reverse, args=scan))

    return FusedZeCOGLA.apply(q, k, v, g, scale, scan_fn)
