"""The single-device GLA operator on CUDA: fla's chunk_gla rebuilt from fla's stages
(kernels/fla_stages.py), with the choices of `GLAStages` (kernels/common.py):
  fwd_intra / bwd_intra  whose intra-chunk stage, forward A and backward dq/dk: "zeco" ours
                         (kernels/gla_intra.py, one program per chunk) or "fla"
  side_stream            fla's state scans (h; in the backward h and dh) on a second CUDA stream
                         beside the intra-chunk stages: a scan runs a few dozen programs one chunk
                         after another and leaves most of the GPU idle, the intra stages need no state
Every other stage, the saved tensors and the precisions are fla's (ChunkGLAFunction): h in 16 bits in
the forward, recomputed in fp32 in the backward; the gate cumsum kept when g is fp32, recomputed from
16-bit gates. Dense sequences only (fla's contract without cu_seqlens); packed documents keep fla's
chunk_gla. Shapes as fla names them: q, k, g [B, T, H, K], v [B, T, H, V], h0 and ht [B, H, K, V].
"""
from __future__ import annotations

import torch

from . import fla_stages as fla
from .common import GLAStages, check_intra_stage
from .gla_intra import chunk_gla_bwd_dqk_intra, chunk_gla_fwd_A
from .zeco_stages import fla_chunk_size


def A_intra(q, k, g_cs, scale: float, BT: int, fwd_intra: str = "zeco"):
    """The intra-chunk scores A [B, T, H, BT], fp32, by the chosen stage (ours needs K ≤ 256)."""
    check_intra_stage("fwd_intra", fwd_intra)
    if fwd_intra == "zeco" and q.shape[-1] <= 256:
        return chunk_gla_fwd_A(q, k, g_cs, scale, BT)
    return fla.chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cs, scale=scale, chunk_size=BT)


def dqk_intra(q, k, g_cs, dA, BT: int, bwd_intra: str = "zeco"):
    """The intra-chunk parts of (dq, dk), fp32, by the chosen stage."""
    check_intra_stage("bwd_intra", bwd_intra)
    if bwd_intra == "zeco":
        return chunk_gla_bwd_dqk_intra(q, k, g_cs, dA, BT)
    return fla.chunk_gla_bwd_dqk_intra(q=q, k=k, g=g_cs, dA=dA, chunk_size=BT)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class _Beside:
    """Work run through `run` goes to the device's side stream, after everything the current stream
    has enqueued so far; `join(*outputs)` makes the current stream wait for it and marks the outputs
    (allocated on the side stream) as used by the current one. Off: both run inline."""

    def __init__(self, on: bool, device: torch.device):
        self.side = None
        if on:
            self.main = torch.cuda.current_stream(device)
            self.side = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
            self.side.wait_stream(self.main)

    def run(self, fn, **kwargs):
        if self.side is None:
            return fn(**kwargs)
        with torch.cuda.stream(self.side):
            return fn(**kwargs)

    def join(self, *outputs):
        if self.side is not None:
            self.main.wait_stream(self.side)
            if torch.cuda.is_current_stream_capturing():  # a graph's memory pool lives as long as the graph
                return
            for t in outputs:
                if t is not None:
                    t.record_stream(self.main)


class ChunkGLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, scale, h0, output_final_state, stages: GLAStages):
        q, k, v, g = (t.contiguous() for t in (q, k, v, g))
        BT = fla_chunk_size(q.shape[1])
        g_cs = fla.gate_cumsum(g, BT)
        side = _Beside(stages.side_stream, q.device)
        h, ht = side.run(fla.chunk_fwd_h, k=k, v=v, gk=g_cs, h0=h0, output_final_state=output_final_state,
                         chunk_size=BT)
        A = A_intra(q, k, g_cs, scale, BT, stages.fwd_intra)
        side.join(h, ht)
        o = fla.chunk_gla_fwd_o_gk(q=q, v=v, g=g_cs, A=A, h=h, scale=scale, chunk_size=BT)
        keep_cs = g.dtype == torch.float  # as fla: the fp32 cumsum costs no more memory than fp32 g
        ctx.save_for_backward(q, k, v, None if keep_cs else g, g_cs if keep_cs else None, h0, A)
        ctx.scale, ctx.BT, ctx.stages = scale, BT, stages
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, g_cs, h0, A = ctx.saved_tensors
        scale, BT, stages = ctx.scale, ctx.BT, ctx.stages
        do = do.contiguous()
        if g_cs is None:
            g_cs = fla.gate_cumsum(g, BT)
        side = _Beside(stages.side_stream, q.device)  # the two scans, one after the other
        h, _ = side.run(fla.chunk_fwd_h, k=k, v=v, gk=g_cs, h0=h0, output_final_state=False, chunk_size=BT,
                        states_in_fp32=True)
        dh, dh0 = side.run(fla.chunk_bwd_dh, q=q, k=k, v=v, do=do, h0=h0, dht=dht, scale=scale, gk=g_cs,
                           chunk_size=BT, states_in_fp32=True)
        dA = fla.chunk_gla_bwd_dA(v=v, do=do, scale=scale, chunk_size=BT)
        dq, dk = dqk_intra(q, k, g_cs, dA, BT, stages.bwd_intra)
        side.join(h, dh, dh0)
        dv = fla.chunk_gla_bwd_dv(k=k, g=g_cs, A=A, do=do, dh=dh, chunk_size=BT)
        dq, dk, dg = fla.chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=h, g=g_cs, do=do, dh=dh, dq=dq, dk=dk, scale=scale,
                                            chunk_size=BT)
        return dq.to(q), dk.to(k), dv.to(v), dg, None, dh0, None, None


def chunk_gla_staged(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                     stages: GLAStages = GLAStages()):
    """fla's chunk_gla contract (dense): (o [B, T, H, V], final state [B, H, K, V] or None)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ChunkGLA.apply(q, k, v, g, scale, initial_state, output_final_state, stages)


__all__ = ["A_intra", "ChunkGLA", "chunk_gla_staged", "dqk_intra"]
