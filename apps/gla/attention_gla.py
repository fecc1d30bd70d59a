"""Gated Linear Attention (model.attn_variant=gla | simple_gla), sequence-parallel through
lingua_zeco.sp.sp_gla / sp_simple_gla, with fla's parameter names (GatedLinearAttention /
SimpleGatedLinearAttention): q, k, v, g, o projections, gk_proj the forget gate, g_norm_swish_gate.
"""
from __future__ import annotations

import torch.nn as nn

from apps.gla.layers import GatedRMSNorm, GLAArgs, LinearAttention, log_forget_gate
from lingua_zeco.sp import SPContext, sp_gla, sp_gla_carry, sp_simple_gla


class GatedLinearAttention(LinearAttention):
    def __init__(self, args: GLAArgs, sp: SPContext):
        super().__init__(args, sp)
        d, kd, vd = args.dim, args.key_dim, args.value_dim
        self.gate_logit_normalizer = args.gate_logit_normalizer
        self.g_proj = nn.Linear(d, vd, bias=False)
        self.variant = args.attn_variant
        if self.variant == "simple_gla":  # one forget gate per head, as fla's SimpleGatedLinearAttention
            self.gk_proj = nn.Linear(d, args.n_heads, bias=True)
        else:  # Low-rank forget gate: hidden -> 16 -> key_dim (with bias), as in fla.
            self.gk_proj = nn.Sequential(nn.Linear(d, args.gate_low_rank_dim, bias=False),
                                         nn.Linear(args.gate_low_rank_dim, kd, bias=True))
        self.o_proj = nn.Linear(vd, d, bias=False)
        self.g_norm_swish_gate = GatedRMSNorm(self.head_v, args.norm_eps, args.fused_kernels)
        self.compile_gates = args.compile_gates

    def _inputs(self, x):
        """q, k, v (_qkv) and the log forget gate: [B, T, H, K] (gla) or [B, T, H] (simple_gla)."""
        q, k, v = self._qkv(x)
        gk = log_forget_gate(self.gk_proj(x).view(*x.shape[:2], self.n_heads, -1).squeeze(-1),
                             self.gate_logit_normalizer, self.compile_gates)
        return q, k, v, gk

    def forward(self, x, cu_seqlens=None, carry=None):
        """carry (lingua_zeco.sp.StateCarry): one segment of a longer sequence, from this layer's carried
        state; its final state goes back into carry (model.segment_len, lingua_zeco/segments.py)."""
        q, k, v, gk = self._inputs(x)
        if carry is not None:
            o, state = sp_gla_carry(q, k, v, gk, carry.state_in(self.layer_idx), sp=self.sp, cu_seqlens=cu_seqlens)
            carry.put(self.layer_idx, state)
        else:
            o = (sp_simple_gla if self.variant == "simple_gla" else sp_gla)(q, k, v, gk, sp=self.sp,
                                                                            cu_seqlens=cu_seqlens)
        return self._output(o, x)

    def _state_inputs(self, x):
        q, k, v, g = self._inputs(x)
        if self.variant == "simple_gla":
            g = g[..., None].expand_as(q)  # a per-head decay is a per-key decay that is constant over K
        return q, k, v, g

    def _step(self, state, k, v, g):
        """S <- diag(exp(g)) S + k v^T."""
        return g.exp()[..., None] * state + k[..., None] * v[..., None, :]

    def _chunk(self, q, k, v, g, state):
        return self.sp.gla.chunk_gla(q, k, v, g.to(q.dtype), initial_state=state, output_final_state=True)
