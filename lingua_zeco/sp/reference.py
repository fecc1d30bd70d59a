"""zeco and lasp2 for GLA composed of whole kernels: the reference the fused operators (fused_zeco.py,
fused_packed.py) are tested against, and the path wherever they do not run (no fla, packed documents).

Run the slice from a zero state, obtain the true incoming state S_in by a scan over the ranks (ScanFn:
the All-Scan for zeco, the all-gather for lasp2), and add its contribution
o_t += scale · (q_t ⊙ b_t)ᵀ S_in  (b_t: the gate product from the slice start to t). Autograd
differentiates the correction, including through b_t into g. (LASP-1 is in lasp1.py.)
"""
from __future__ import annotations

import torch

from lingua_zeco import kernels
from lingua_zeco.comm import DECAY

from .context import SPContext
from .state_passing import ScanFn
from .varlen import LocalSegments, incoming_decay


def scan_then_correct(q_BTHK, k_BTHK, v_BTHV, g_BTHK, *, scale, sp: SPContext, seg: LocalSegments):
    """This rank's slice under sp.method (zeco: the All-Scan with sp.scan's settings; lasp2: the all-gather)."""
    o_BTHV, S_loc_NHKV = sp.gla.chunk_gla(q_BTHK, k_BTHK, v_BTHV, g_BTHK, scale=scale, output_final_state=True,
                                          cu_seqlens=seg)
    acc = kernels.acc_dtype(q_BTHK.dtype, g_BTHK.dtype)
    # exchange and correction in acc even under autocast, which would run the einsum's bmm in bf16
    with torch.autocast(q_BTHK.device.type, enabled=False):
        S_end_BHKV = (S_loc_NHKV[-1:] if seg.cu_seqlens is not None else S_loc_NHKV).to(acc)
        b_BTHK = incoming_decay(g_BTHK, seg).to(acc)
        b_end_BHK = b_BTHK[:, -1].contiguous()
        S_in_BHKV = ScanFn.apply(S_end_BHKV, b_end_BHK, sp.group, sp.scan if sp.method == "zeco" else None, DECAY)
        corr_BTHV = torch.einsum("bthk,bhkv->bthv", q_BTHK.to(acc) * b_BTHK, S_in_BHKV.to(acc))
        return (o_BTHV.to(acc) + scale * corr_BTHV).to(o_BTHV.dtype)
