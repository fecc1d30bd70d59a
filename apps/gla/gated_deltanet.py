"""Gated DeltaNet attention (model.attn_variant=gated_deltanet), sequence-parallel through
lingua_zeco.sp.sp_gated_delta (zeco / lasp1 / lasp2 / none / local, as the GLA variants).

Simplified from fla's GatedDeltaNet layer (fla.layers.gated_deltanet), parameter names kept:
  q, k, v = silu(q_proj x), silu(k_proj x), silu(v_proj x)       (q, k L2-normalised per head)
  β       = sigmoid(b_proj x)                                      one per head and token
  g       = −exp(A_log) · softplus(a_proj x + dt_bias)             log decay ≤ 0, one per head and token
  o       = o_proj( RMSNorm(delta_rule(q, k, v, g, β)) · swish(g_proj x) )   (o_norm, per head)
Differences from fla's layer, on purpose:
* no short causal convolution on q, k, v (fla: ShortConvolution, kernel 4). Under SP it would need
  the previous rank's last 3 tokens (a halo exchange), which is a separate piece of work;
* head dims follow GLAArgs (key_dim = dim·expand_k, value_dim = dim·expand_v, n_heads heads), no
  grouped value heads, no negative eigenvalues (β ∈ (0, 1));
* initialisation: the model's init_weights draws every matrix N(0, init_std), zeroes biases and sets
  other 1-D parameters to 1, so A_log = 1 and dt_bias = 0 (decay exp(−e·ln 2) ≈ 0.15 per token at
  init, trainable). fla draws A ~ U(0, 16) and dt ∈ [1e-3, 1e-1] (much slower decay); this module
  does that in its constructor, which only matters when it is used without init_weights.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from apps.gla.layers import GatedRMSNorm, GLAArgs, LinearAttention
from lingua_zeco.kernels import acc_dtype
from lingua_zeco.kernels.delta import chunk_gated_delta, l2norm
from lingua_zeco.sp import SPContext, sp_gated_delta


class GatedDeltaNet(LinearAttention):
    out_norm = "o_norm"

    def __init__(self, args: GLAArgs, sp: SPContext):
        super().__init__(args, sp)
        d, vd, H = args.dim, args.value_dim, args.n_heads
        self.a_proj = nn.Linear(d, H, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.g_proj = nn.Linear(d, vd, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v, args.norm_eps, args.fused_kernels)
        self.o_proj = nn.Linear(vd, d, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, generator: torch.Generator | None = None) -> None:
        """fla's ranges: A ~ U(0, 16) (floored), dt log-uniform in [1e-3, 1e-1], dt_bias = softplus⁻¹(dt)."""
        H = self.n_heads
        A = torch.empty(H).uniform_(0, 16, generator=generator).clamp(min=1e-4)
        dt = torch.exp(torch.rand(H, generator=generator) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt = dt.clamp(min=1e-4)
        self.A_log.copy_(A.log().to(self.A_log))
        self.dt_bias.copy_((dt + torch.log(-torch.expm1(-dt))).to(self.dt_bias))

    def _inputs(self, x):
        """silu(q, k, v) (_qkv); the log decay g and write strength beta [B, T, H]."""
        q, k, v = (F.silu(t) for t in self._qkv(x))
        acc = acc_dtype(x.dtype)  # gates in fp32 at least (fp64 stays fp64)
        beta = self.b_proj(x).to(acc).sigmoid()
        g = -self.A_log.to(acc).exp() * F.softplus(self.a_proj(x).to(acc) + self.dt_bias.to(acc))
        return q, k, v, g, beta

    def forward(self, x, cu_seqlens=None):
        o = sp_gated_delta(*self._state_inputs(x), sp=self.sp, cu_seqlens=cu_seqlens)
        return self._output(o, x)

    def _state_inputs(self, x):
        """q and k L2-normalised (fla's use_qk_l2norm_in_kernel=True), v and the gates: the kernels' inputs."""
        q, k, v, g, beta = self._inputs(x)
        return l2norm(q), l2norm(k), v, g, beta

    def _step(self, state, k, v, g, beta):
        """S <- exp(g) S, then S += beta k (v - S^T k)^T: the delta rule's write of the prediction error."""
        state = g.exp()[..., None, None] * state
        err = v - torch.einsum("bhk,bhkv->bhv", k, state)
        return state + beta[..., None, None] * k[..., None] * err[..., None, :]

    def _chunk(self, q, k, v, g, beta, state):
        return chunk_gated_delta(q, k, v, (g, beta), initial_state=state, output_final_state=True)
