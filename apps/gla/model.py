"""GLA language model whose attention runs sequence-parallel through `lingua_zeco.sp.sp_gla`.

Parameter names follow fla's `GLAForCausalLM` (default config: fuse_norm=True), so exporting is a
no-op renaming: model.embeddings, model.layers.{i}.{attn_norm, attn.{q,k,v,g,o}_proj, attn.gk_proj.{0,1},
attn.g_norm_swish_gate, mlp_norm, mlp.{gate,up,down}_proj}, model.norm, lm_head.

On CUDA the norms, SwiGLU and the loss use fla's fused Triton modules; elsewhere the same maths in
plain torch. Each rank holds T_local tokens of one global sequence; the loss it returns is the *sum*
over its tokens, with the token count, so the trainer can normalise by the global count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lingua_zeco import kernels
from lingua_zeco.sp import sp_gla, sp_simple_gla

AC_MODES = ("none", "full", "selective")
ATTN_VARIANTS = ("gla", "simple_gla", "gated_deltanet")  # gated_deltanet: apps/gla/gated_deltanet.py


@dataclass
class GLAArgs:
    dim: int = 2048  # hidden size
    n_layers: int = 20  # blocks of attention + SwiGLU MLP
    n_heads: int = 16  # attention heads (each with a head_k x head_v state)
    expand_k: float = 1.0  # key dim = dim * expand_k (fla's convention)
    expand_v: float = 1.0  # value dim = dim * expand_v
    ffn_hidden: int = 5632  # 0 = fla's rule: 8/3 * dim rounded up to a multiple of 256
    vocab_size: int = 32000  # 0 = the tokenizer's n_words
    norm_eps: float = 1e-6  # RMSNorm epsilon
    gate_low_rank_dim: int = 16  # gla: rank of the forget-gate projection (fla: 16)
    gate_logit_normalizer: int = 16  # log forget gate = logsigmoid(.) / this (fla: 16)
    tie_embeddings: bool = False  # the LM head shares the embedding matrix
    init_std: float = 0.02  # std of the normal init of every matrix
    fused_kernels: bool = True  # fla Triton norms / SwiGLU / linear cross-entropy when on CUDA
    activation_checkpointing: str = "none"  # none | full (whole block) | selective (MLP half only)
    chunk_size: int = 64  # GLA chunk length, only used by the FLOP count
    # gla: one forget gate per key channel (gk_proj low rank: dim -> 16 -> key_dim);
    # simple_gla: one per head (RetNet style, fla's SimpleGatedLinearAttention: gk_proj dim -> n_heads);
    # gated_deltanet: the gated delta rule (apps/gla/gated_deltanet.py)
    attn_variant: str = "gla"
    # parameter / compute dtype off CUDA: fp32 | fp64 (exactness checks such as SP-size parity; the
    # norms and the loss compute in at least fp32, so fp64 stays fp64). CUDA runs keep fp32 + bf16 autocast.
    dtype: str = "fp32"

    @property
    def key_dim(self) -> int:
        return _exact(self.dim * self.expand_k, "dim * expand_k")

    @property
    def value_dim(self) -> int:
        return _exact(self.dim * self.expand_v, "dim * expand_v")

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden > 0:
            return self.ffn_hidden
        return 256 * math.ceil(int(self.dim * 8 / 3) / 256)


def _exact(x: float, what: str) -> int:
    if not math.isclose(x, round(x)):
        raise ValueError(f"{what} must be an integer, got {x}")
    return round(x)


DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Compute dtype of the norms and the loss: fp32 at least (bf16 -> fp32, fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _fla():
    """fla's fused modules, imported only when a CUDA tensor needs them (the import is slow)."""
    from fla.modules.activations import swiglu_linear
    from fla.modules.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm

    return rms_norm, rms_norm_gated, swiglu_linear, FusedLinearCrossEntropyLoss


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.fused = eps, fused

    def forward(self, x):
        if self.fused and x.is_cuda:
            return _fla()[0](x, self.weight, None, eps=self.eps)
        xf = x.to(_acc(x.dtype))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(o) * swish(g) over each head's value vector (fla's FusedRMSNormGated)."""

    def forward(self, x, g):
        if self.fused and x.is_cuda:
            return _fla()[1](x, g, self.weight, None, activation="swish", eps=self.eps)
        y = super().forward(x).to(_acc(x.dtype))
        return (y * F.silu(g.to(y.dtype))).to(x.dtype)


class GatedLinearAttention(nn.Module):
    def __init__(self, args: GLAArgs, sp_group=None, sp_method: str = "none", sp_scan=None):
        super().__init__()
        d, kd, vd = args.dim, args.key_dim, args.value_dim
        if kd % args.n_heads or vd % args.n_heads:
            raise ValueError(f"key dim {kd} and value dim {vd} must be divisible by n_heads={args.n_heads}")
        self.n_heads, self.head_k, self.head_v = args.n_heads, kd // args.n_heads, vd // args.n_heads
        self.gate_logit_normalizer = args.gate_logit_normalizer
        self.sp_group, self.sp_method, self.sp_scan = sp_group, sp_method, sp_scan  # sp_scan: AllScanArgs
        self.q_proj = nn.Linear(d, kd, bias=False)
        self.k_proj = nn.Linear(d, kd, bias=False)
        self.v_proj = nn.Linear(d, vd, bias=False)
        self.g_proj = nn.Linear(d, vd, bias=False)
        if args.attn_variant not in ATTN_VARIANTS:
            raise ValueError(f"model.attn_variant={args.attn_variant!r}; choose from {ATTN_VARIANTS}")
        self.variant = args.attn_variant
        if self.variant == "simple_gla":  # one forget gate per head, as fla's SimpleGatedLinearAttention
            self.gk_proj = nn.Linear(d, args.n_heads, bias=True)
        else:  # Low-rank forget gate: hidden -> 16 -> key_dim (with bias), as in fla.
            self.gk_proj = nn.Sequential(nn.Linear(d, args.gate_low_rank_dim, bias=False),
                                         nn.Linear(args.gate_low_rank_dim, kd, bias=True))
        self.o_proj = nn.Linear(vd, d, bias=False)
        self.g_norm_swish_gate = GatedRMSNorm(self.head_v, args.norm_eps, args.fused_kernels)

    def _inputs(self, x):
        """q, k [B, T, H, K], v [B, T, H, V] and the log forget gate: [B, T, H, K] (gla) or [B, T, H] (simple_gla)."""
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k, self.head_v
        q = self.q_proj(x).view(B, T, H, K)
        k = self.k_proj(x).view(B, T, H, K)
        v = self.v_proj(x).view(B, T, H, V)
        gk = F.logsigmoid(self.gk_proj(x).view(B, T, H, -1).squeeze(-1)) / self.gate_logit_normalizer
        return q, k, v, gk

    def _output(self, o, x):
        B, T, _ = x.shape
        o = self.g_norm_swish_gate(o.to(x.dtype), self.g_proj(x).view(B, T, self.n_heads, self.head_v))
        return self.o_proj(o.reshape(B, T, -1))

    def forward(self, x, cu_seqlens=None):
        q, k, v, gk = self._inputs(x)
        attn = sp_simple_gla if self.variant == "simple_gla" else sp_gla
        o = attn(q, k, v, gk, group=self.sp_group, method=self.sp_method, cu_seqlens=cu_seqlens, scan=self.sp_scan)
        return self._output(o, x)

    @torch.no_grad()
    def forward_with_state(self, x, state=None):
        """Generation: x [B, T, D] continuing from `state` [B, H, K, V] (None = zeros), one device, no SP.
        Returns (output, new state in fp32 at least). One token costs one state update; a prompt, the
        chunked kernel started from the state."""
        q, k, v, g = self._inputs(x)
        if self.variant == "simple_gla":
            g = g[..., None].expand_as(q)  # a per-head decay is a per-key decay that is constant over K
        if x.shape[1] == 1 and state is not None:  # S <- diag(exp(g)) S + k v^T, o = scale q^T S
            q1, k1, v1, g1 = (t[:, 0].to(state.dtype) for t in (q, k, v, g))
            state = g1.exp()[..., None] * state + k1[..., None] * v1[..., None, :]
            o = (self.head_k ** -0.5) * torch.einsum("bhk,bhkv->bhv", q1, state)[:, None]
        else:
            o, state = kernels.chunk_gla(q, k, v, g.to(q.dtype), initial_state=state, output_final_state=True)
            state = state.to(_acc(q.dtype))
        return self._output(o, x), state


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, fused: bool):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.fused = fused

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.fused and x.is_cuda:
            return _fla()[2](gate, up, self.down_proj.weight, self.down_proj.bias)
        return self.down_proj(F.silu(gate) * up)


class GLABlock(nn.Module):
    def __init__(self, args: GLAArgs, sp_group=None, sp_method: str = "none", sp_scan=None):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, args.fused_kernels)
        if args.attn_variant == "gated_deltanet":
            from apps.gla.gated_deltanet import GatedDeltaNet  # imports this module: import on use
            self.attn = GatedDeltaNet(args, sp_group, sp_method, sp_scan)
        else:
            self.attn = GatedLinearAttention(args, sp_group, sp_method, sp_scan)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps, args.fused_kernels)
        self.mlp = SwiGLU(args.dim, args.ffn_dim, args.fused_kernels)
        if args.activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing={args.activation_checkpointing!r}; choose from {AC_MODES}")
        self.ac = args.activation_checkpointing

    def _attn_half(self, x, cu_seqlens):
        return x + self.attn(self.attn_norm(x), cu_seqlens)

    def _mlp_half(self, x):
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x, cu_seqlens=None):
        if self.ac == "full" and torch.is_grad_enabled():
            # Recomputing the attention re-runs its SP exchange in backward: the price of full AC.
            return checkpoint(self._block, x, cu_seqlens, use_reentrant=False)
        x = self._attn_half(x, cu_seqlens)
        if self.ac == "selective" and torch.is_grad_enabled():
            # The MLP holds most activations (ffn ~2.75x dim) and recomputes without communication.
            return checkpoint(self._mlp_half, x, use_reentrant=False)
        return self._mlp_half(x)

    def _block(self, x, cu_seqlens):
        return self._mlp_half(self._attn_half(x, cu_seqlens))


class GLAModel(nn.Module):
    def __init__(self, args: GLAArgs, sp_group=None, sp_method: str = "none", sp_scan=None):
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(GLABlock(args, sp_group, sp_method, sp_scan) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.fused_kernels)

    def forward(self, input_ids, cu_seqlens=None):
        h = self.embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, cu_seqlens)
        return self.norm(h)


class GLAForCausalLM(nn.Module):
    def __init__(self, args: GLAArgs, sp_group=None, sp_method: str = "none", sp_scan=None):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (the trainer fills 0 from the tokenizer)")
        self.args = args
        self.model = GLAModel(args, sp_group, sp_method, sp_scan)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embeddings.weight
        if args.dtype not in DTYPES:
            raise ValueError(f"model.dtype={args.dtype!r}; choose from {tuple(DTYPES)}")
        self.to(DTYPES[args.dtype])

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded and independent of device, SP size and rank: every rank draws the full tensors
        from one CPU generator in parameter order (before sharding), as fla initialises them."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():  # tied weights are listed once
            if name.endswith("bias"):
                vals = torch.zeros(p.shape)
            elif p.ndim == 1:  # norm weights
                vals = torch.ones(p.shape)
            else:
                vals = torch.empty(p.shape).normal_(0.0, self.args.init_std, generator=gen)
            p.copy_(vals.to(device=p.device, dtype=p.dtype))

    def forward(self, input_ids, labels=None, cu_seqlens=None):
        """labels None: logits [B, T, V]. Otherwise (sum of token losses, number of counted tokens):
        the caller divides by the *global* count, which keeps the mean exact across dp x sp ranks."""
        h = self.model(input_ids, cu_seqlens)
        if labels is None:
            return self.lm_head(h)
        n_tokens = (labels != -100).sum()
        if self.args.fused_kernels and h.is_cuda:
            # Never materialises the [tokens, vocab] logits (1 GiB in fp32 at 16K x 32K). fla's default
            # accumulates the head's weight gradient in fp32, which runs as a non-tensor-core SGEMM:
            # 42.8 ms of a 370 ms GLA-1B step at 16K on an H200 (docs/results/performance.md).
            loss_fn = _fla()[3](reduction="sum", accumulate_grad_in_fp32=False)
            # The weight in h's dtype (a no-op under FSDP's bf16 params; under plain autocast the
            # fp32 weight would otherwise drag the whole head into fp32 matmuls).
            loss = loss_fn(h.reshape(-1, h.shape[-1]), labels.reshape(-1), self.lm_head.weight.to(h.dtype))
        else:
            logits = self.lm_head(h).to(_acc(h.dtype))
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        return loss, n_tokens

    @property
    def blocks(self):
        return list(self.model.layers)


def count_params(args: GLAArgs) -> dict:
    """Analytic parameter counts (tested against the module): total, embedding, head, non-embedding."""
    d, kd, vd, f = args.dim, args.key_dim, args.value_dim, args.ffn_dim
    r = args.gate_low_rank_dim
    gate = d * args.n_heads + args.n_heads if args.attn_variant == "simple_gla" else d * r + r * kd + kd
    if args.attn_variant == "gated_deltanet":  # a_proj, b_proj (dim -> n_heads), A_log, dt_bias
        gate = 2 * (d * args.n_heads + args.n_heads)
    attn = d * kd * 2 + d * vd * 2 + vd * d + gate + vd // args.n_heads
    layer = attn + 3 * d * f + 2 * d
    body = args.n_layers * layer + d
    emb = args.vocab_size * d
    head = 0 if args.tie_embeddings else args.vocab_size * d
    return dict(total=body + emb + head, embedding=emb, head=head, non_embedding=body)


def flops_per_token(args: GLAArgs) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), counted honestly for GLA:

    * 6 * N_non_embedding for the weight matmuls (embedding lookups cost nothing);
    * 6 * dim * vocab for the LM head (tied or not, it is a matmul);
    * chunked GLA per layer, head and token (forward): the causal half of the intra-chunk
      QK^T and AV blocks, C*(K+V), plus the state read q.S (2*K*V) and state update k^T v (2*K*V).
    There is no quadratic softmax term: the cost is linear in the sequence length.
    """
    H = args.n_heads
    K, V = args.key_dim // H, args.value_dim // H
    attn_fwd = args.n_layers * H * (args.chunk_size * (K + V) + 4 * K * V)
    return 6 * count_params(args)["non_embedding"] + 6 * args.dim * args.vocab_size + 3 * attn_fwd
