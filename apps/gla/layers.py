"""What the model (apps/gla/model.py) and its attention variants (attention_gla.py, gated_deltanet.py)
share: the model's arguments, the norms (fla's fused ones on CUDA), and the base of the attention layers.
Nothing here imports the model or a variant: model.py picks the variant, the variants import this.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from lingua_zeco.kernels import GLAOptions, acc_dtype
from lingua_zeco.segments import SEGMENT_GRADS  # model.segment_grad
from lingua_zeco.sp import SPContext


COMPILE_MODES = ("auto", "blocks", "none")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# torch.compile's mode for the blocks (inductor): reduce-overhead replays each compiled block from a CUDA graph
# (static shapes and parameter addresses: one GPU with distributed.fsdp=false)
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
SEGMENT_VARIANTS = ("gla", "simple_gla")  # attention variants that carry their state across segments


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
    compile_gates: bool = True  # CUDA: the forget gate's logsigmoid / normalizer as one torch.compile'd kernel
    # torch.compile per block (apps/gla/compile.py): blocks | none | auto (blocks on CUDA without SP, else none).
    # Compiled, the norms, gates, SwiGLU and residuals are fused by Inductor and the GLA operator is one
    # opaque custom op (lingua_zeco.kernels.chunk_gla_op); fused_kernels then applies outside the blocks only.
    compile: str = "auto"
    compile_backend: str = "inductor"  # torch.compile's backend (aot_eager: tracing and autograd only, for tests)
    compile_mode: str = "default"  # torch.compile's mode (TORCH_COMPILE_MODES; inductor only)
    # torchao float8 training of the block linears (apps/gla/compile.py): none | tensorwise | rowwise
    float8: str = "none"
    float8_head: bool = False  # the LM head in float8 too (its loss then materialises the logits)
    # CUDA: the GLA operator keeps the forward's chunk states (16 bits) for the backward instead of recomputing
    # them (lingua_zeco.kernels.GLAOptions.save_h): 2·T_local·H·K·V/64 bytes per GLA layer until its backward
    # (GLA-1B at 16K tokens: 128 MiB a layer, 2.5 GiB in all) for one state pass fewer per layer. false: where
    # memory is short (the memory check names it)
    gla_save_h: bool = True
    activation_checkpointing: str = "none"  # none | full (whole block) | selective (MLP half only)
    # tokens per GPU of one segment: the step trains the sequence segment by segment with exact gradients,
    # carrying each layer's state (lingua_zeco/segments.py; docs/long_context.md). 0 = the whole sequence
    segment_len: int = 0
    # exact: the gradient of the whole sequence (one extra forward per step) | truncated: truncated
    # backpropagation through time (the states carried forward, no gradient across segment boundaries)
    segment_grad: str = "exact"
    chunk_size: int = 64  # GLA chunk length, only used by the FLOP count
    # gla: one forget gate per key channel (gk_proj low rank: dim -> 16 -> key_dim);
    # simple_gla: one per head (RetNet style, fla's SimpleGatedLinearAttention: gk_proj dim -> n_heads);
    # gated_deltanet: the gated delta rule (apps/gla/gated_deltanet.py)
    attn_variant: str = "gla"
    # parameter / compute dtype off CUDA: fp32 | fp64 (exactness checks such as SP-size parity; the
    # norms and the loss compute in at least fp32, so fp64 stays fp64). CUDA runs keep fp32 + bf16 autocast.
    dtype: str = "fp32"
    # Hybrid models (apps/gla/attention_softmax.py): these block indices (0-based) run causal softmax
    # attention with RoPE instead of model.attn_variant, width dim and n_heads heads (fla's GLAConfig.attn)
    softmax_layers: list[int] = field(default_factory=list)
    softmax_window: int | None = None  # null: full causal; W: each query sees itself and the W-1 tokens before
    softmax_backend: str = "auto"  # sdpa | xformers | auto (xformers for masked cases when it runs on this GPU)
    rope_theta: float = 10000.0  # RoPE base of the softmax layers

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

    # keys older run folders hold (their config.yaml still loads, with a warning; on the command line: an error)
    RETIRED: ClassVar[dict[str, str]] = {
        "gla_bwd_intra": "since 2026-12-04 the GLA operator has one set of stages (our whole-chunk intra-chunk "
                         "stages; the others measured slower, docs/results/README.md)",
        "gla_split": "since 2026-12-04 the in-GPU segment split is gone (slower than the unsplit operator at every "
                     "length measured, docs/results/README.md)"}

    def gla_options(self) -> GLAOptions:
        """The GLA operator's options this model runs with (lingua_zeco.distributed.setup puts them into the SP
        context)."""
        return GLAOptions(save_h=self.gla_save_h)

    def check(self) -> None:
        """Sizes no model can have, named by key (a 0 would surface as a ZeroDivisionError deep in init)."""
        for key in ("dim", "n_layers", "n_heads", "gate_low_rank_dim", "gate_logit_normalizer"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        for key in ("expand_k", "expand_v", "norm_eps", "init_std", "rope_theta"):
            if not getattr(self, key) > 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be > 0")
        if self.ffn_hidden < 0:
            raise ValueError(f"model.ffn_hidden={self.ffn_hidden} must be >= 0 (0 = fla's rule, 8/3 x dim)")
        if self.vocab_size < 0:
            raise ValueError(f"model.vocab_size={self.vocab_size} must be >= 0 (0 = the tokenizer's)")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"model.compile={self.compile!r}; choose from {COMPILE_MODES}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"model.compile_backend={self.compile_backend!r}; choose from {COMPILE_BACKENDS}")
        if self.compile_mode not in TORCH_COMPILE_MODES:
            raise ValueError(f"model.compile_mode={self.compile_mode!r}; choose from {TORCH_COMPILE_MODES}")
        if self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"model.float8={self.float8!r}; choose from {FLOAT8_RECIPES}")
        if self.float8_head and self.float8 == "none":
            raise ValueError("model.float8_head=true needs model.float8=tensorwise or rowwise")
        if self.segment_len < 0:
            raise ValueError(f"model.segment_len={self.segment_len} must be >= 0 (0 = the whole sequence at once)")
        if self.segment_grad not in SEGMENT_GRADS:
            raise ValueError(f"model.segment_grad={self.segment_grad!r}; choose from {SEGMENT_GRADS}")
        if self.segment_len and (self.attn_variant not in SEGMENT_VARIANTS or self.softmax_layers):
            what = (f"model.softmax_layers={list(self.softmax_layers)} (softmax attention carries no fixed-size state)"
                    if self.softmax_layers else f"model.attn_variant={self.attn_variant!r}")
            raise ValueError(f"model.segment_len={self.segment_len} trains segment by segment, which needs every "
                             f"layer's state carried across segments: {what} cannot; use attn_variant in "
                             f"{SEGMENT_VARIANTS} "
                             f"without softmax layers, or model.segment_len=0")


def _exact(x: float, what: str) -> int:
    if not math.isclose(x, round(x)):
        raise ValueError(f"{what} must be an integer, got {x}")
    return round(x)


def fused_here(fused: bool, x) -> bool:
    """Whether a module runs fla's fused Triton kernel: fused_kernels on CUDA, outside torch.compile'd code
    (there Inductor fuses the torch maths itself). fla is imported on first use: the import is slow."""
    return fused and x.is_cuda and not torch.compiler.is_compiling()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.fused = eps, fused

    def forward(self, x):
        if fused_here(self.fused, x):
            from fla.modules.norm.layernorm import rms_norm
            return rms_norm(x, self.weight, None, eps=self.eps)
        xf = x.to(acc_dtype(x.dtype))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(o) * swish(g) over each head's value vector (fla's FusedRMSNormGated)."""

    def forward(self, x, g):
        if fused_here(self.fused, x):
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            return rms_norm_gated(x, g, self.weight, None, activation="swish", eps=self.eps)
        y = super().forward(x).to(acc_dtype(x.dtype))
        return (y * F.silu(g.to(y.dtype))).to(x.dtype)


class LinearAttention(nn.Module):
    """Base of the attention variants: heads of a [head_k, head_v] state, the SP context, q/k/v projections
    (registered first, as in fla), the output o_proj(norm(o) * swish(g_proj x)) (the norm: submodule
    `out_norm`), generation. A variant adds its parameters, `forward` and, for generation, `_state_inputs`
    (q, k, v, its gates), `_step` (one token's state update), `_chunk` (a prompt, from a state)."""

    out_norm = "g_norm_swish_gate"

    def __init__(self, args: GLAArgs, sp: SPContext):
        super().__init__()
        d, kd, vd, H = args.dim, args.key_dim, args.value_dim, args.n_heads
        if kd % H or vd % H:
            raise ValueError(f"key dim {kd} and value dim {vd} must be divisible by n_heads={H}")
        self.n_heads, self.head_k, self.head_v = H, kd // H, vd // H
        self.sp = sp
        self.layer_idx = 0  # the block's index (GLABlock sets it): this layer's slot in a StateCarry
        self.q_proj = nn.Linear(d, kd, bias=False)
        self.k_proj = nn.Linear(d, kd, bias=False)
        self.v_proj = nn.Linear(d, vd, bias=False)

    def _qkv(self, x):
        """q, k [B, T, H, K] and v [B, T, H, V]: the projections of x [B, T, D], split into heads."""
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k, self.head_v
        q, k = self.q_proj(x).view(B, T, H, K), self.k_proj(x).view(B, T, H, K)
        return q, k, self.v_proj(x).view(B, T, H, V)

    def _output(self, o, x):
        B, T, _ = x.shape
        norm = getattr(self, self.out_norm)
        o = norm(o.to(x.dtype), self.g_proj(x).view(B, T, self.n_heads, self.head_v))
        return self.o_proj(o.reshape(B, T, -1))

    @torch.no_grad()
    def forward_with_state(self, x, state=None):
        """Generation: x [B, T, D] continuing from `state` [B, H, K, V] (None = zeros), one device, no SP.
        Returns (output, new state in fp32 at least). One token costs one state update, o = scale S^T q;
        a prompt, the chunked kernel started from the state."""
        q, k, v, *gates = self._state_inputs(x)
        if x.shape[1] == 1 and state is not None:
            q1, k1, v1, *gates1 = (t[:, 0].to(state.dtype) for t in (q, k, v, *gates))
            state = self._step(state, k1, v1, *gates1)
            o = (self.head_k ** -0.5) * torch.einsum("bhk,bhkv->bhv", q1, state)[:, None]
        else:
            o, state = self._chunk(q, k, v, *gates, state)
            state = state.to(acc_dtype(q.dtype))
        return self._output(o, x), state


def _log_gate(z, normalizer: float):
    return F.logsigmoid(z) / normalizer


@functools.cache
def _compiled_log_gate():
    return torch.compile(_log_gate, fullgraph=True)


def log_forget_gate(z, normalizer: float, compiled: bool = True):
    """fla's GLA forget gate, logsigmoid(z) / normalizer. compiled (CUDA only): one torch.compile'd
    kernel each way instead of an eager logsigmoid, a division and their two backward kernels."""
    if compiled and z.is_cuda and not torch.compiler.is_compiling():  # a compiled block traces it anyway
        return _compiled_log_gate()(z, normalizer)
    return _log_gate(z, normalizer)
