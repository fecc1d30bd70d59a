"""Run a loaded fla GLAForCausalLM (default fused config) on CPU: swap its Triton-only pieces for torch.

Same approach as tests/test_model.py's fixture: fla's naive recurrence for the GLA kernel, torch
RMSNorm (with fla's residual/prenorm contract) for its fused norms, torch gated norm for
g_norm_swish_gate, torch SwiGLU. Projections, wiring, gates, residuals and head stay fla's code.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TorchRMSNorm(nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.eps = weight, eps

    def _norm(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None:
            x = x + residual
        y = self._norm(x)
        return (y, x) if prenorm else y


class TorchRMSNormGated(TorchRMSNorm):
    def forward(self, x, g, *args, **kwargs):
        return (self._norm(x).float() * F.silu(g.float())).to(x.dtype)


def fla_model_on_cpu(model, monkeypatch):
    import fla.layers.gla as fla_gla
    import fla.modules.mlp as fla_mlp
    from fla.modules import RMSNorm as FlaRMSNorm
    from fla.ops.gla.naive import naive_recurrent_gla

    def naive(q, k, v, g=None, gk=None, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
        assert cu_seqlens is None and initial_state is None
        return naive_recurrent_gla(q, k, v, g if g is not None else gk)[0], None

    monkeypatch.setattr(fla_gla, "chunk_gla", naive)
    monkeypatch.setattr(fla_gla, "fused_recurrent_gla", naive)
    monkeypatch.setattr(fla_mlp, "swiglu", lambda gate, y: F.silu(gate) * y)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name == "g_norm_swish_gate":
                setattr(module, child_name, TorchRMSNormGated(child.weight, child.eps))
            elif isinstance(child, FlaRMSNorm):
                setattr(module, child_name, TorchRMSNorm(child.weight, child.eps))
            elif child_name == "mlp":
                child.fuse_swiglu = False
    return model
