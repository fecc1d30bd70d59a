"""Run a loaded fla GLAForCausalLM or GatedDeltaNetForCausalLM (default fused config) on CPU: swap
its Triton-only pieces for torch (Triton has no CPU driver: "0 active drivers").

Same approach as tests/test_model.py's fixture: fla's naive recurrences for the GLA and gated-delta
kernels (with fla's own naive gate for the in-kernel GDN gate), torch RMSNorm (with fla's
residual/prenorm contract) for its fused norms, torch gated norm for g_norm_swish_gate / o_norm,
torch SwiGLU. Projections, wiring, gates, residuals and head stay fla's code.
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


def _naive_gated_delta(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                       cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                       dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, **_):
    """fla's chunk/fused_recurrent_gated_delta_rule contract, through fla's naive pieces."""
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    assert cu_seqlens is None and initial_state is None and not allow_neg_eigval
    if use_qk_l2norm_in_kernel:  # fla's l2norm: x / sqrt(sum x^2 + 1e-6)
        q, k = (x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6).to(x.dtype) for x in (q, k))
    if use_gate_in_kernel:
        g = naive_gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid()
    o, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=scale)
    return o, None


def fla_model_on_cpu(model, monkeypatch):
    import fla.layers.gated_deltanet as fla_gdn
    import fla.layers.gla as fla_gla
    import fla.modules.mlp as fla_mlp
    from fla.modules import FusedRMSNormGated
    from fla.modules import RMSNorm as FlaRMSNorm
    from fla.ops.gla.naive import naive_recurrent_gla

    def naive(q, k, v, g=None, gk=None, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
        assert cu_seqlens is None and initial_state is None
        return naive_recurrent_gla(q, k, v, g if g is not None else gk)[0], None

    monkeypatch.setattr(fla_gla, "chunk_gla", naive)
    monkeypatch.setattr(fla_gla, "fused_recurrent_gla", naive)
    monkeypatch.setattr(fla_gdn, "chunk_gated_delta_rule", _naive_gated_delta)
    monkeypatch.setattr(fla_gdn, "fused_recurrent_gated_delta_rule", _naive_gated_delta)
    monkeypatch.setattr(fla_mlp, "swiglu", lambda gate, y: F.silu(gate) * y)
    for _name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name == "g_norm_swish_gate" or isinstance(child, FusedRMSNormGated):
                setattr(module, child_name, TorchRMSNormGated(child.weight, child.eps))
            elif isinstance(child, FlaRMSNorm):
                setattr(module, child_name, TorchRMSNorm(child.weight, child.eps))
            elif child_name == "mlp":
                child.fuse_swiglu = False
    return model
