"""Sequence-parallel GLA built from whole kernels (the reference the fused ZeCO path is tested against).

zeco / lasp2: run the slice from a zero state, obtain the true incoming state S_in by a scan over
ranks, and add its contribution  o_t += scale · (q_t ⊙ b_t)ᵀ S_in  (b_t: gate product from the
slice start to t).  Autograd differentiates the correction, including through b_t into g.
lasp1: wait for S_in, run the slice from it, send the final state on (serial over ranks).
"""
from __future__ import annotations

import torch

from lingua_zeco import kernels
from lingua_zeco.comm import AllScanArgs

from .state_passing import AllScanFn, RecvPrevFn, SendNextFn, all_gather_scan
from .varlen import LocalSegments, incoming_decay


def scan_then_correct(q, k, v, g, *, scale, group, method, seg: LocalSegments, backend, scan_args: AllScanArgs):
    o_BTHV, S_loc = kernels.chunk_gla(q, k, v, g, scale=scale, output_final_state=True,
                                      cu_seqlens=seg.cu_seqlens, backend=backend)
    acc = torch.promote_types(torch.promote_types(q.dtype, g.dtype), torch.float32)  # fp32 at least; fp64 stays
    # exchange and correction in acc even under autocast, which would run the einsum's bmm in bf16
    with torch.autocast(q.device.type, enabled=False):
        S_end_BHKV = (S_loc[-1:] if seg.cu_seqlens is not None else S_loc).to(acc)
        b_BTHK = incoming_decay(g, seg).to(acc)
        b_end_BHK = b_BTHK[:, -1].contiguous()
        if method == "zeco":
            S_in_BHKV = AllScanFn.apply(S_end_BHKV, b_end_BHK, group, scan_args)
        else:
            S_in_BHKV = all_gather_scan(S_end_BHKV, b_end_BHK, group)
        corr_BTHV = torch.einsum("bthk,bhkv->bthv", q.to(acc) * b_BTHK, S_in_BHKV.to(acc))
        return (o_BTHV.to(acc) + scale * corr_BTHV).to(o_BTHV.dtype)


def lasp1(q, k, v, g, *, scale, group, seg: LocalSegments, backend):
    B, _, H, K = q.shape
    S_in_BHKV = RecvPrevFn.apply((B, H, K, v.shape[-1]), group, q, k, v, g)
    h0 = S_in_BHKV
    if seg.cu_seqlens is not None:
        # one initial state per local document: only the first may continue from the previous rank
        first = S_in_BHKV if seg.continues else S_in_BHKV * 0  # keep S_in in the graph: its backward must send
        h0 = torch.cat([first, first.new_zeros(seg.n_segments - 1, *first.shape[1:])])
    o_BTHV, S_out = kernels.chunk_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True,
                                      cu_seqlens=seg.cu_seqlens, backend=backend)
    S_out_BHKV = S_out[-1:] if seg.cu_seqlens is not None else S_out
    return SendNextFn.apply(o_BTHV, S_out_BHKV, group)
