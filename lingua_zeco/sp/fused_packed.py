"""ZeCO on fla's varlen stages for a slice of packed documents in which a document starts (CUDA, B = 1).

Rules (docs/sp.md, packed documents): a document starting inside the slice resets the state, so the
slice's outgoing state is its last document's final state alone (b_end = 0, the scan pair is
(0, S_last)), and the incoming state S_in reaches only the prefix [0, t0) that continues the previous
rank's document (t0 = seg.first_end, 0 when a document starts at the slice's first token).
The boundaries and fla's chunk tables come planned from the host once per step (sp/varlen.py), so
no stage here syncs with the host. The prefix is fla's first varlen segment, so its chunks are aligned
as in the dense layout and the dense ZeCO stages apply to it unchanged (prefix views of a B = 1 tensor are contiguous).

Forward:  g_cs, h (zero initial states), S_last → scan starts; A and fla's output stage for the whole
          slice meanwhile; after the wait the prefix's outputs are redone with S_in folded in.
Backward: D from the prefix → reverse scan starts; h recomputed with S_in as the first segment's
          initial state meanwhile; then fla's dh with G as the last segment's final-state gradient, dv,
          and dq/dk/dg in one kernel (gla_bwd_dqkg.py) — fla's varlen backward from (S_in, G).
A slice inside one document (no boundary in it) takes the dense FusedZeCOGLA instead.
"""
from __future__ import annotations

import torch

from lingua_zeco.kernels import chunk_layout
from lingua_zeco.kernels import fla_stages as fla
from lingua_zeco.kernels.gla_chunk import dqkg, dv, fwd_A
from lingua_zeco.kernels.zeco_stages import (chunk_decay_prefix, dS_in_reads_raw_gates, fla_chunk_size, zeco_dS_in,
                                             zeco_fwd_o)


class FusedPackedZeCOGLA(torch.autograd.Function):
    """As FusedZeCOGLA (fused_zeco.py, shapes as there), with fla's varlen stages; seg = the slice's
    LocalSegments, planned once per step (its boundaries and fla's chunk tables are already on the
    GPU: nothing here reads the GPU back), seg.first_end = t0 = the end of the prefix that continues
    the previous rank's document."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, scan_fn, seg):
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        BT = fla_chunk_size(q.shape[1])
        layout, t0 = chunk_layout(BT, seg), seg.first_end
        g_cs_BTHK = fla.gate_cumsum(g, BT, layout.cu_seqlens, layout.chunk_indices)
        h_BNHKV, ht_NHKV = fla.fwd_h(k, v, g_cs_BTHK, None, layout=layout, output_final_state=True)
        b_end_BHK = ht_NHKV.new_zeros(ht_NHKV[-1:].shape[:-1])  # a document starts here: S_in stops
        work = scan_fn(ht_NHKV[-1:].contiguous(), b_end_BHK, False)
        A_BTHC = fwd_A(q, k, g_cs_BTHK, scale, layout)
        o = fla.chunk_gla_fwd_o_gk(q=q, v=v, g=g_cs_BTHK, A=A_BTHC, h=h_BNHKV, scale=scale, **layout.varlen)
        S_in_BHKV = work.wait()
        Gx0_BNHK = None
        if t0 > 0:  # the prefix again, now with S_in folded into its chunk states
            n0 = -(-t0 // BT)
            Gx0_BNHK, _ = chunk_decay_prefix(g_cs_BTHK[:, :t0], BT)
            o[:, :t0] = zeco_fwd_o(q[:, :t0], v[:, :t0], g_cs_BTHK[:, :t0], A_BTHC[:, :t0], h_BNHKV[:, :n0],
                                   (S_in_BHKV.to(h_BNHKV.dtype), Gx0_BNHK), scale)
        ctx.save_for_backward(q, k, v, g, A_BTHC, S_in_BHKV, Gx0_BNHK, b_end_BHK)
        ctx.scale, ctx.scan_fn, ctx.layout, ctx.seg = scale, scan_fn, layout, seg
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, A_BTHC, S_in_BHKV, Gx0_BNHK, b_end_BHK = ctx.saved_tensors
        scale, layout, seg = ctx.scale, ctx.layout, ctx.seg
        BT, t0 = layout.BT, seg.first_end
        do = do.contiguous()
        if t0 > 0:  # D of the prefix first, so that the reverse scan starts early
            g0 = g[:, :t0]
            g_cs0_BTHK = None if dS_in_reads_raw_gates(q, g0) else fla.gate_cumsum(g0, BT)
            D_BHKV = zeco_dS_in(q[:, :t0], g_cs0_BTHK, Gx0_BNHK, do[:, :t0], scale, BT, g=g0)
        else:
            D_BHKV = torch.zeros_like(S_in_BHKV)
        work = ctx.scan_fn(D_BHKV, b_end_BHK, True)
        g_cs_BTHK = fla.gate_cumsum(g, BT, layout.cu_seqlens, layout.chunk_indices)
        N = seg.n_segments
        h0_NHKV = S_in_BHKV.new_zeros(N, *S_in_BHKV.shape[1:])
        if t0 > 0:
            h0_NHKV[0] = S_in_BHKV[0]
        h_BNHKV, _ = fla.fwd_h(k, v, g_cs_BTHK, h0_NHKV, layout=layout, output_final_state=False, states_in_fp32=True)
        G_BHKV = work.wait()
        dht_NHKV = G_BHKV.new_zeros(N, *G_BHKV.shape[1:])
        dht_NHKV[-1] = G_BHKV[0]
        dh_BNHKV, _ = fla.bwd_dh(q, do, dht_NHKV, g_cs_BTHK, scale=scale, layout=layout)
        dv_ = dv(k, g_cs_BTHK, A_BTHC, do, dh_BNHKV, layout)
        dq, dk, dg = dqkg((q, k, v, g_cs_BTHK), h_BNHKV, dh_BNHKV, do, scale, (q.dtype, k.dtype, g.dtype), layout)
        return dq, dk, dv_.to(v), dg, None, None, None
