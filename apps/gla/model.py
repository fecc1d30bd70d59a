"""GLA language model whose attention runs sequence-parallel through `lingua_zeco.sp.sp_gla`.

Parameter names follow fla's `GLAForCausalLM` (default config: fuse_norm=True), so exporting is a
no-op renaming: model.embeddings, model.layers.{i}.{attn_norm, attn.{q,k,v,g,o}_proj, attn.gk_proj.{0,1},
attn.g_norm_swish_gate, mlp_norm, mlp.{gate,up,down}_proj}, model.norm, lm_head.

On CUDA the norms, SwiGLU and the loss use fla's fused Triton modules; elsewhere the same maths in
plain torch. Each rank holds T_local tokens of one global sequence; the loss it returns is the *sum*
over its tokens, with the token count, so the trainer can normalise by the global count.
The block's attention is model.attn_variant's (ATTENTION): attention_gla.py, gated_deltanet.py;
the arguments and the pieces they share are in layers.py. Hybrids: the blocks in model.softmax_layers
run causal softmax attention with RoPE instead (attention_softmax.py, fla's GLAConfig.attn names),
sequence-parallel by distributed.softmax_sp.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from apps.gla.attention_gla import GatedLinearAttention
from apps.gla.attention_softmax import SoftmaxAttention, softmax_layer_set
from apps.gla.gated_deltanet import GatedDeltaNet
from apps.gla.layers import GLAArgs, RMSNorm, fused_here
from lingua_zeco.kernels import acc_dtype
from lingua_zeco.meta_init import like_param
from lingua_zeco.sp import SPContext
from lingua_zeco.sp.varlen import as_packing

AC_MODES = ("none", "full", "selective")
ATTENTION = {"gla": GatedLinearAttention, "simple_gla": GatedLinearAttention, "gated_deltanet": GatedDeltaNet}
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _silu_mul(gate, up):
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, fused: bool):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.fused = fused

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if fused_here(self.fused, x):
            from fla.modules.activations import swiglu_linear
            return swiglu_linear(gate, up, self.down_proj.weight, self.down_proj.bias)
        if torch.compiler.is_compiling():
            # Recompute silu(gate) * up in the backward (as fla's swiglu_linear does) instead of letting the
            # partitioner keep it: one [tokens, ffn] tensor per block less for a fused pointwise recompute
            return self.down_proj(checkpoint(_silu_mul, gate, up, use_reentrant=False))
        return self.down_proj(_silu_mul(gate, up))


class GLABlock(nn.Module):
    def __init__(self, args: GLAArgs, sp: SPContext, layer_idx: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, args.fused_kernels)
        if args.attn_variant not in ATTENTION:
            raise ValueError(f"model.attn_variant={args.attn_variant!r}; choose from {tuple(ATTENTION)}")
        if layer_idx in softmax_layer_set(args):
            self.attn = SoftmaxAttention(args, sp)
        else:
            self.attn = ATTENTION[args.attn_variant](args, sp)
        self.attn.layer_idx = layer_idx
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps, args.fused_kernels)
        self.mlp = SwiGLU(args.dim, args.ffn_dim, args.fused_kernels)
        if args.activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing={args.activation_checkpointing!r}; choose from {AC_MODES}")
        self.ac = args.activation_checkpointing
        self.compiled = None  # apps/gla/compile.py: this block's forward as a torch.compile'd function

    def _attn_half(self, x, cu_seqlens, carry=None):
        if carry is None:
            return x + self.attn(self.attn_norm(x), cu_seqlens)
        return x + self.attn(self.attn_norm(x), cu_seqlens, carry)

    def _mlp_half(self, x):
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x, cu_seqlens=None, carry=None):
        """carry: a segment's StateCarry (lingua_zeco.sp), which runs the block uncompiled."""
        # the compiled function is called from forward, so FSDP2's hooks on this module stay outside it
        if self.compiled is not None and carry is None:
            return self.compiled(self, x, cu_seqlens)
        return self.run(x, cu_seqlens, carry)

    def run(self, x, cu_seqlens=None, carry=None):
        """The block's computation (what model.compile=blocks compiles), activation checkpointing inside."""
        if self.ac == "full" and torch.is_grad_enabled():
            # Recomputing the attention re-runs its SP exchange in backward: the price of full AC.
            return checkpoint(self._block, x, cu_seqlens, carry, use_reentrant=False)
        x = self._attn_half(x, cu_seqlens, carry)
        if self.ac == "selective" and torch.is_grad_enabled():
            # The MLP holds most activations (ffn ~2.75x dim) and recomputes without communication.
            return checkpoint(self._mlp_half, x, use_reentrant=False)
        return self._mlp_half(x)

    def _block(self, x, cu_seqlens, carry=None):
        return self._mlp_half(self._attn_half(x, cu_seqlens, carry))


class GLAModel(nn.Module):
    def __init__(self, args: GLAArgs, sp: SPContext):
        super().__init__()
        softmax_layer_set(args)  # bad indices: one error before any block is built
        self.embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(GLABlock(args, sp, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.fused_kernels)
        self.sp = sp

    def forward(self, input_ids, cu_seqlens=None, carry=None):
        # packed documents planned once for every layer (no host sync inside the layers)
        rank, P = self.sp.rank_size
        packing = as_packing(cu_seqlens, rank=rank, P=P, T_local=input_ids.shape[1], device=input_ids.device)
        h = self.embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, packing) if carry is None else layer(h, packing, carry)
        return self.norm(h)


class GLAForCausalLM(nn.Module):
    def __init__(self, args: GLAArgs, sp: SPContext | None = None):
        """sp: the sequence parallelism the layers run under (DistEnv.sp from lingua_zeco.distributed.setup;
        None: one rank, no exchange, the GLA operator as the model's args say)."""
        super().__init__()
        args.check()
        if args.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (the trainer fills 0 from the tokenizer)")
        self.args = args
        self.model = GLAModel(args, sp or SPContext(method="none", gla=args.gla_options()))
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
            p.copy_(like_param(vals, p))  # an FSDP2 DTensor: this rank's shard of the full tensor

    def forward(self, input_ids, labels=None, cu_seqlens=None, carry=None, head: bool = True):
        """labels None: logits [B, T, V]. Otherwise (sum of token losses, number of counted tokens):
        the caller divides by the *global* count, which keeps the mean exact across dp x sp ranks.
        carry: one segment of a longer sequence (lingua_zeco.sp.StateCarry: the layers' states in and out);
        head=False: the layers only (returns None), for the states a segment hands on."""
        h = self.model(input_ids, cu_seqlens, carry)
        if not head:
            return None
        if labels is None:
            return self.lm_head(h)
        n_tokens = (labels != -100).sum()
        if self.args.fused_kernels and h.is_cuda and not self.args.float8_head:  # float8_head: lm_head's own GEMM
            # Never materialises the [tokens, vocab] logits. fla's default accumulates the head's weight
            # gradient in fp32, which runs as a non-tensor-core SGEMM, a large share of a GLA-1B step on an
            # H200 (docs/results/README.md, "History").
            from fla.modules.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss
            loss_fn = FusedLinearCrossEntropyLoss(reduction="sum", accumulate_grad_in_fp32=False)
            # fla's function is not autocast-aware: under plain autocast (fp32 parameters, distributed.fsdp=false)
            # h is fp32 (the residual stream) and the head's GEMM ran as a slow fp32 SIMT SGEMM
            # (docs/results/README.md, "History"). h and the weight in the autocast
            # dtype, as nn.Linear would be; a no-op under FSDP's bf16 parameters.
            if torch.is_autocast_enabled("cuda"):
                h = h.to(torch.get_autocast_dtype("cuda"))
            loss = loss_fn(h.reshape(-1, h.shape[-1]), labels.reshape(-1), self.lm_head.weight.to(h.dtype))
        else:
            logits = self.lm_head(h).to(acc_dtype(h.dtype))
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        return loss, n_tokens

    @property
    def blocks(self):
        return list(self.model.layers)


def count_params(args: GLAArgs) -> dict:
    """Analytic parameter counts (tested against the module): total, embedding, head, non-embedding."""
    d, kd, vd, f, r = args.dim, args.key_dim, args.value_dim, args.ffn_dim, args.gate_low_rank_dim
    gate = d * args.n_heads + args.n_heads if args.attn_variant == "simple_gla" else d * r + r * kd + kd
    if args.attn_variant == "gated_deltanet":  # a_proj, b_proj (dim -> n_heads), A_log, dt_bias
        gate = 2 * (d * args.n_heads + args.n_heads)
    linear = d * kd * 2 + d * vd * 2 + vd * d + gate + vd // args.n_heads
    n_soft = len(softmax_layer_set(args))
    attn = (args.n_layers - n_soft) * linear + n_soft * 4 * d * d  # softmax: q, k, v, o (dim x dim, no bias)
    body = attn + args.n_layers * (3 * d * f + 2 * d) + d
    emb = args.vocab_size * d
    head = 0 if args.tie_embeddings else args.vocab_size * d
    return dict(total=body + emb + head, embedding=emb, head=head, non_embedding=body)


def visible_keys(context: int, window: int | None) -> float:
    """Mean number of keys a query sees in causal attention over `context` tokens: (T + 1) / 2, or with a
    sliding window W the mean of min(t, W) over t = 1..T."""
    T, W = context, window if window is not None else context
    W = min(W, T)
    return (W * (W + 1) / 2 + (T - W) * W) / T


def flops_per_token(args: GLAArgs, context: int | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), counted honestly:

    * 6 * N_non_embedding for the weight matmuls (embedding lookups cost nothing);
    * 6 * dim * vocab for the LM head (tied or not, it is a matmul);
    * chunked GLA per linear-attention layer, head and token (forward): the causal half of the
      intra-chunk QK^T and AV blocks, C*(K+V), plus the state read q.S (2*K*V) and state update k^T v (2*K*V).
      Linear in the sequence length: no quadratic term;
    * softmax layers (model.softmax_layers), per layer and token (forward): QK^T and AV over the keys the
      query sees, 2 * 2 * dim * visible_keys(context, window) (the causal half, the window when set).
      This needs `context`, the tokens of one (global) training sequence, sp_size x seq_len; with packed
      documents it is an upper bound (attention stops at document boundaries).
    """
    H = args.n_heads
    K, V = args.key_dim // H, args.value_dim // H
    n_soft = len(softmax_layer_set(args))
    attn_fwd = (args.n_layers - n_soft) * H * (args.chunk_size * (K + V) + 4 * K * V)
    if n_soft:
        if not context:
            raise ValueError(f"flops_per_token: model.softmax_layers={list(args.softmax_layers)} cost depends on "
                             f"the context; pass context=<tokens per sequence> (sp_size x seq_len)")
        attn_fwd += n_soft * 4 * args.dim * visible_keys(context, args.softmax_window)
    return 6 * count_params(args)["non_embedding"] + 6 * args.dim * args.vocab_size + 3 * attn_fwd
