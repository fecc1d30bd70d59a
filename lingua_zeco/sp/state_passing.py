"""The differentiable exchange of states for zeco and lasp2: S_in by a scan over the SP group's ranks.

ScanFn.apply(x, a, group, args, transition) is the exclusive scan of the pairs (a_p, x_p) over the
ranks, y_0 = 0, y_{p+1} = a_p·y_p + x_p (lingua_zeco.comm: transition DECAY for GLA's decays a [..., K],
MATRIX for the delta rule's transitions A [..., K, K]), by comm.all_scan with `args` (zeco's All-Scan)
or, with args=None, by comm.gather_scan (lasp2: one all-gather of every rank's pair, a local fold).
Backward: E_p = ∂L/∂(a_p·y_p + x_p) obeys E_p = dy_{p+1} + a_{p+1}ᵀ E_{p+1}, i.e. E is the reverse
scan of dy under the adjoint transitions (the same exchange, run backwards); then ∂L/∂x_p = E_p and
∂L/∂a_p = transition.grad_a(E_p, y_p) (Σ_V E ⊙ y for decays, E yᵀ for matrices).
The serial hand-over of lasp1 is in lasp1.py.
"""
from __future__ import annotations

import torch

from lingua_zeco.comm import all_scan, gather_scan


class ScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BHKV, a, group, args, transition):
        y_BHKV = _scan(x_BHKV, a, group, args, transition, reverse=False)
        ctx.save_for_backward(a, y_BHKV)
        ctx.group, ctx.args, ctx.transition = group, args, transition
        return y_BHKV

    @staticmethod
    def backward(ctx, dy_BHKV):
        a, y_BHKV = ctx.saved_tensors
        tr = ctx.transition
        with torch.autocast(a.device.type, enabled=False):  # autocast would run A @ E and E yᵀ in bf16
            E_BHKV = _scan(dy_BHKV.to(a.dtype).contiguous(), tr.adjoint(a), ctx.group, ctx.args, tr, reverse=True)
            return E_BHKV, tr.grad_a(E_BHKV, y_BHKV), None, None, None


def _scan(x_BHKV, a, group, args, transition, reverse: bool):
    if args is None:
        return gather_scan(x_BHKV, a, group, reverse=reverse, transition=transition)
    return all_scan(x_BHKV, a, group, reverse, args=args, transition=transition)
