"""Peak memory per GPU of a GLA language model under FSDP + sequence parallelism.

static      = n_params * (master + optimizer [+ grad if grads_live] bytes) / fsdp
              + (prefetch_layers + 1) * layer_params * 2       (unsharded bf16 params / grads in flight)
activations = T_local * [n_layers * act_per_token_layer   (no checkpointing)
                         or n_layers * 2 d + act_per_token_layer   (full checkpointing: layer inputs,
                                                                     plus one layer recomputed)]
logits      = min(T_local, logits_chunk) * vocab * 10 B   (bf16 logits, fp32 upcast, fp32 grad)
sp extras   = saved S_in per layer (zeco / lasp1); P gathered states for one layer (lasp2)

Segment-recurrent training (segment_len = s > 0 tokens per GPU, n = ceil(T_local / s) segments): a forward
without autograd keeps each segment's incoming states, then the segments run forward + backward in reverse
order, handing the state gradient back. The peak is the backward of the second segment processed, so:
activations, logits and the sp extras count one segment (s tokens, not T_local); the fp32 grads are live
(they accumulate from the first segment's backward on) whenever n > 1; and
segment_states = (n - 1 boundaries + 1 state-gradient set) * n_layers * B * H * head_k * head_v * 4 B.
segment_len = 0, or >= T_local, is one segment: exactly the model without segments.
Checked against the peak memory of fla's GLAForCausalLM on one H200 (docs/results/raw/2026-11-30-h200-perf,
before_train_{16k,32k}.json): see tests/test_perf_model.py and docs/perf_model.md §5.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .inputs import assumed

GiB = float(1 << 30)


@dataclass
class ModelShapeArgs:
    vocab: int = 32000
    dim: int = 2048
    n_layers: int = 20
    n_heads: int = 16
    head_k: int = 128  # key (and gate) dim per head
    head_v: int = 128
    ffn: int = 5632
    gate_low_rank: int = 16  # fla GLA's forget-gate projection d -> r -> K
    tie_embeddings: bool = False

    def layer_params(self) -> int:
        d, kd, vd = self.dim, self.n_heads * self.head_k, self.n_heads * self.head_v
        attn = d * kd * 2 + d * vd * 2 + vd * d  # q, k, v, output gate, o_proj
        gate = d * self.gate_low_rank + self.gate_low_rank * kd + kd  # low-rank forget gate (+bias)
        mlp = 3 * d * self.ffn  # SwiGLU gate, up, down
        norms = 2 * d + self.head_v
        return attn + gate + mlp + norms

    def n_params(self) -> int:
        emb = self.vocab * self.dim
        return self.n_layers * self.layer_params() + emb * (1 if self.tie_embeddings else 2) + self.dim

    def act_bytes_per_token_layer(self) -> int:
        """Tensors one GLA layer keeps for backward, per token (bf16 unless noted)."""
        d, kd, vd, H = self.dim, self.n_heads * self.head_k, self.n_heads * self.head_v, self.n_heads
        attn = 2 * (2 * d)  # residual input, normed input (shared by all projections)
        attn += 2 * (kd + kd + vd + vd)  # q, k, v, output gate
        attn += 4 * kd * 2 + 2 * self.gate_low_rank  # forget gate and its chunk cumsum (fp32)
        attn += 4 * H * 64  # intra-chunk scores A (chunk 64, fp32) saved by chunk_gla
        attn += 2 * (vd * 2)  # o and its gated norm (o_proj input)
        mlp = 2 * (2 * d) + 2 * (3 * self.ffn)  # residual, normed, gate, up, silu(gate)*up
        return attn + mlp


@dataclass
class MemoryArgs:
    T_local: int = 16384  # tokens per GPU (local slice under SP)
    batch: int = 1
    fsdp: int = 0  # GPUs the params, grads, optimizer states are sharded over; 0 = the SP group (sp)
    master_bytes: int = 4  # fp32 parameters
    grad_bytes: int = 4  # fp32 gradients (autocast); 2 with bf16 FSDP reduce
    grads_live: bool = False  # zero_grad(set_to_none) frees grads: at the peak (start of backward) none exist
    optim_bytes: int = 8  # AdamW exp_avg + exp_avg_sq in fp32
    act_ckpt: str = "none"  # none | full
    act_bytes_override: int = 0  # measured bytes/token/layer; 0 = formula
    logits_chunk: int = 0  # tokens per chunk of the loss; 0 = whole sequence at once
    prefetch_layers: int = 1  # FSDP keeps this many extra layers unsharded
    method: str = "zeco"  # none | zeco | lasp1 | lasp2
    sp: int = 1
    segment_len: int = 0  # tokens per GPU per segment of segment-recurrent training; 0 = the whole T_local
    overhead_gib: float = assumed("mem.overhead_gib")  # CUDA context, NCCL buffers, allocator slack
    shape: ModelShapeArgs = field(default_factory=ModelShapeArgs)


def n_segments(args: MemoryArgs) -> int:
    """Segments one step runs per GPU: ceil(T_local / segment_len); 1 when segment_len is 0."""
    if args.segment_len < 0:
        raise ValueError(f"segment_len must be >= 0 (0 = the whole T_local), not {args.segment_len}")
    return -(-args.T_local // args.segment_len) if args.segment_len else 1


def segment_state_bytes(args: MemoryArgs) -> int:
    """The boundary states kept for the step plus the one state-gradient set in flight (fp32), when n > 1."""
    n = n_segments(args)
    s = args.shape
    per_set = s.n_layers * args.batch * s.n_heads * s.head_k * s.head_v * 4
    boundaries = n - 1  # segment 0 starts from zeros
    return (boundaries + 1) * per_set if n > 1 else 0


def peak_memory(args: MemoryArgs) -> dict:
    """Bytes per component and the total, in GiB."""
    s = args.shape
    n = s.n_params()
    segments = n_segments(args)
    seg_len = args.segment_len if segments > 1 else args.T_local
    tokens = seg_len * args.batch  # what one forward with autograd holds: one segment
    grads_live = args.grads_live or segments > 1
    per_param = args.master_bytes + args.optim_bytes + (args.grad_bytes if grads_live else 0)
    fsdp = args.fsdp or args.sp
    static = n * per_param / fsdp
    inflight = (args.prefetch_layers + 1) * s.layer_params() * 2 if fsdp > 1 else 0
    per_layer = args.act_bytes_override or s.act_bytes_per_token_layer()
    if args.act_ckpt == "none":
        act = tokens * s.n_layers * per_layer
    elif args.act_ckpt == "full":
        act = tokens * (s.n_layers * 2 * s.dim + per_layer)
    else:
        raise ValueError(f"act_ckpt must be none or full, not {args.act_ckpt!r}")
    chunk = min(tokens, args.logits_chunk) if args.logits_chunk > 0 else tokens
    logits = chunk * s.vocab * (2 + 4 + 4)
    state = args.batch * s.n_heads * s.head_k * s.head_v * 4
    if args.method in ("zeco", "lasp1") and args.sp > 1:
        # saved for the backward: S_in, and (zeco) the gate sums at chunk starts Gx [B, T/64, H, K] fp32
        gx = args.batch * -(-seg_len // 64) * s.n_heads * s.head_k * 4 if args.method == "zeco" else 0
        sp_extra = s.n_layers * (state + gx)
    elif args.method == "lasp2" and args.sp > 1:
        sp_extra = s.n_layers * state + args.sp * state  # own state per layer + one gathered set
    else:
        sp_extra = 0
    parts = dict(sharded_states=static, fsdp_inflight=inflight, activations=act, logits=logits,
                 sp_states=sp_extra, segment_states=segment_state_bytes(args), overhead=args.overhead_gib * GiB)
    return {**{k: v / GiB for k, v in parts.items()}, "total": sum(parts.values()) / GiB, "n_params": n}


def act_bytes_from_peak(args: MemoryArgs, peak_gib: float) -> int:
    """The activation bytes per token and layer (act_bytes_override) that make peak_memory(args) equal a
    measured peak: the formula above is fla's model's, another trainer keeps other tensors. The activations
    are linear in that figure (logits and everything else stay as modelled), so one measured run of the
    trainer (e.g. one unsegmented length) fixes it for every length and segment_len."""
    one = peak_memory(replace(args, act_bytes_override=1))
    return round((peak_gib - (one["total"] - one["activations"])) / one["activations"])
