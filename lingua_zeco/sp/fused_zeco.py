"""ZeCO on fla's kernel stages, with the All-Scan overlapped with the intra-chunk work (CUDA).

Forward on rank p (fla's chunk_gla_fwd, reordered; chunk size by fla's rule):
  1. g_cs = chunk-local cumsum of g (base 2, as fla keeps it)                    fla
  2. h, S_end = chunk states from a ZERO state            → S_end is ready early    fla
  3. Gx, b_end = gate sums from the slice start to each chunk (one small launch)  zeco_stages
  4. All-Scan(S_end, b_end) starts                                    ┐ overlapped
  5. A = intra-chunk attention (needs no state)                       ┘           fla
  6. o = output stage with S_in folded into each chunk's state in registers      zeco_stages
     (save_h: the same stage writes those true states back into h, kept for the backward)
Backward: fla's backward with initial_state = S_in and final-state gradient G from the next rank.
G is not known at the start, so D = ∂L/∂S_in of this slice comes first:
  1. g_cs (fla); D = scale·Σ_t (q_t ⊙ b_t)ᵀ do_t (one read of q, g_cs, do)         zeco_stages
  2. reverse All-Scan of (D, b_end) → G starts                        ┐
  3. h recomputed from S_in (unless kept: then only the gate cumsum  ┘ overlapped  fla
     runs beside the scan, as dA and the intra-chunk parts are in step 5's kernel)
  4. dh with the final-state gradient G, then dv                                 fla
  5. dq, dk, dg in one kernel: dA, the intra-chunk and the inter-chunk parts     ours (gla_bwd_dqkg.py)
     (dg includes the decays of S_in and G: h carries S_in, dh carries G)
The extra work against plain fla chunk_gla is the D pass, the chunk gate sums and the fold inside
the output stage: no pass rewrites the chunk states h or dh. fla's stages come through
lingua_zeco/kernels/fla_stages.py, ours from lingua_zeco/kernels/zeco_stages.py.
The scan runs on a side stream (overlapped) or on the caller's stream at the same points, as
`AllScanArgs.overlap` says: on, off, or auto = whichever measured faster in the run's first calls.
LASP-2 runs on the same stages (lasp2_scan_fn): the exchange is its all-gather instead.
Shapes: q, k, g, dq, dk, dg [B, T, H, K] and v, do, o, dv [B, T, H, V] (fla's names, as its stages take
them); suffixes elsewhere, with N = the NT chunks and C = the BT tokens of a chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lingua_zeco.comm import AllScanArgs, ScanWork, gather_scan
from lingua_zeco.kernels import ChunkLayout
from lingua_zeco.kernels import fla_stages as fla
from lingua_zeco.kernels.gla_chunk import dqkg, dv, fwd_A
from lingua_zeco.kernels.zeco_stages import (chunk_decay_prefix, dS_in_reads_raw_gates, fla_chunk_size, zeco_dS_in,
                                             zeco_fwd_o)

from .fused_packed import FusedPackedZeCOGLA
from .overlap import CHOOSER, post


def zeco_forward(q, k, v, g, scale, scan_fn, save_h: bool = True):
    """The forward stages on contiguous inputs: (o, what zeco_backward reads). scan_fn(x, a, reverse) -> a
    handle with wait(): the exclusive scan of the slices' (state, decay) pairs, started before the intra-chunk
    stage and waited for after it. save_h: the chunk states from S_in are kept (16 bits, as
    kernels.GLAOptions.save_h) for the backward."""
    BT = fla_chunk_size(q.shape[1])
    layout = ChunkLayout(BT)
    g_cs_BTHK = fla.gate_cumsum(g, BT)
    h_BNHKV, S_end_BHKV = fla.fwd_h(k, v, g_cs_BTHK, None, layout=layout, output_final_state=True)
    Gx_BNHK, b_end_BHK = chunk_decay_prefix(g_cs_BTHK, BT)
    work = scan_fn(S_end_BHKV, b_end_BHK, False)
    A_BTHC = fwd_A(q, k, g_cs_BTHK, scale, layout)
    S_in_BHKV = work.wait()
    o = zeco_fwd_o(q, v, g_cs_BTHK, A_BTHC, h_BNHKV, (S_in_BHKV.to(h_BNHKV.dtype), Gx_BNHK), scale, store_h=save_h)
    kept = (h_BNHKV,) if save_h else ()
    return o, (A_BTHC, S_in_BHKV, Gx_BNHK, b_end_BHK, *kept)


def zeco_backward(q, k, v, g, saved, do, scale, scan_fn):
    """(dq, dk, dv, dg) from the forward's inputs, what zeco_forward kept and the output gradient do."""
    A_BTHC, S_in_BHKV, Gx_BNHK, b_end_BHK, *kept = saved
    BT = fla_chunk_size(q.shape[1])
    layout = ChunkLayout(BT)
    do = do.contiguous()
    # D first, so the scan starts as early as possible: from 16-bit gates D makes its own cumsum
    g_cs_BTHK = None if dS_in_reads_raw_gates(q, g) else fla.gate_cumsum(g, BT)
    D_BHKV = zeco_dS_in(q, g_cs_BTHK, Gx_BNHK, do, scale, BT, g=g)
    work = scan_fn(D_BHKV, b_end_BHK, True)
    if g_cs_BTHK is None:
        g_cs_BTHK = fla.gate_cumsum(g, BT)
    if kept:
        h_BNHKV, = kept
    else:
        h_BNHKV, _ = fla.fwd_h(k, v, g_cs_BTHK, S_in_BHKV, layout=layout, output_final_state=False,
                               states_in_fp32=True)
    G_BHKV = work.wait()
    dh_BNHKV, _ = fla.bwd_dh(q, do, G_BHKV, g_cs_BTHK, scale=scale, layout=layout)  # 16 bits, as gla_chunk.py
    dv_ = dv(k, g_cs_BTHK, A_BTHC, do, dh_BNHKV, layout)
    dq, dk, dg = dqkg((q, k, v, g_cs_BTHK), h_BNHKV, dh_BNHKV, do, scale, (q.dtype, k.dtype, g.dtype), layout)
    return dq, dk, dv_.to(v), dg


class FusedZeCOGLA(torch.autograd.Function):
    """scan_fn(x, a, reverse) -> handle with wait(): the All-Scan over the SP group (injectable so that
    one GPU can run several virtual ranks in one process for tests and benchmarks)."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, scan_fn, save_h: bool = True):
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        o, saved = zeco_forward(q, k, v, g, scale, scan_fn, save_h)
        ctx.save_for_backward(q, k, v, g, *saved)
        ctx.scale, ctx.scan_fn = scale, scan_fn
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, *saved = ctx.saved_tensors
        return (*zeco_backward(q, k, v, g, saved, do, ctx.scale, ctx.scan_fn), None, None, None)


def zeco_scan_fn(group, scan: AllScanArgs):
    """ZeCO's scan_fn: the All-Scan overlapped with the intra-chunk work, or blocking, as scan.overlap says
    (auto: whichever measured faster, sp/overlap.py)."""
    def scan_fn(x, a, reverse):  # returns a handle; the caller computes until it waits
        if scan.overlap == "auto" and x.is_cuda and dist.get_world_size(group) > 1:
            return CHOOSER.scan(x, a, group, reverse, scan)
        return post(x, a, group, reverse, scan, overlapped=scan.overlap != "off")
    return scan_fn


def lasp2_scan_fn(group):
    """LASP-2's scan_fn on the same stages: the all-gather of every rank's (state, decay) and a local scan,
    blocking, as LASP-2 is (its cost is the P-state collective)."""
    def scan_fn(x, a, reverse):
        return ScanWork(gather_scan(x, a, group, reverse=reverse))
    return scan_fn


def fused_zeco_apply(q, k, v, g, scale, sp, seg):
    """The fused operator for this slice under sp.method (zeco or lasp2): dense (also a slice inside one packed
    document; sp.gla.save_h applies) or packed (its states are recomputed)."""
    scan_fn = lasp2_scan_fn(sp.group) if sp.method == "lasp2" else zeco_scan_fn(sp.group, sp.scan)
    if seg.carries:
        return FusedZeCOGLA.apply(q, k, v, g, scale, scan_fn, sp.gla.save_h)
    return FusedPackedZeCOGLA.apply(q, k, v, g, scale, scan_fn, seg)
