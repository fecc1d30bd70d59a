"""Refuse, before allocating anything, a model whose training state cannot fit the device.

A model too large for a CPU is otherwise killed by the kernel's OOM killer without a word, after
minutes of allocating; on a GPU it ends in an out-of-memory traceback. The estimate is a lower bound
(so a run that fits is never refused):

    states       n_params * (weights + AdamW's two moments), fp32 (fp64 with model.dtype=fp64),
                 divided over the FSDP shards (dp_shard x sp); gradients are left out (freed between steps)
    activations  tokens per rank * n_layers * what every block keeps for its backward at least:
                 activation_checkpointing=none: the block input and the MLP's input, gate, up and
                 hidden (2 dim + 3 ffn); full / selective: the block input (dim);
                 bf16 on CUDA (autocast), the model's dtype elsewhere
    logits       off CUDA: tokens * vocab in the model's dtype (on CUDA the fused loss chunks them)
    kept_states  model.gla_save_h on CUDA without checkpointing: every GLA layer's chunk states, 16-bit
                 [n_heads, head_k, head_v] per 64 tokens (fla's largest chunk; shorter ones keep more).
                 Counted for every SP method: LASP-1 and the unfused methods keep none, so with them the
                 key only raises the bound by that much (set it off there)
    weight_copies
                 the plain module (no FSDP) on CUDA: autocast's bf16 copy (float8: the 1-byte cast) of every
                 weight outside the embedding, held from its forward matmul to its backward (FSDP gathers
                 them a block at a time)

Segment-recurrent training (segment_len = s > 0 tokens per rank per segment, n = ceil(seq_len / s) segments of
each of the batch's sequences): activations and logits count one segment (batch * s tokens) instead of the
whole slice; the parameter gradients (fp32, sharded like the states) are live, since they accumulate over the
segments' backwards; and segment_states holds the n - 1 boundary states plus the state gradient handed back,
one fp32 [batch, n_heads, head_k, head_v] per linear-attention layer each (softmax layers keep none).

Compared with what this machine can give one rank: CPU: MemAvailable / the ranks on this node;
CUDA: the free memory of the rank's device.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from apps.gla.attention_softmax import softmax_layer_set
from apps.gla.layers import GLAArgs
from apps.gla.model import DTYPES, count_params

GiB = float(1 << 30)


def segments(tokens: int, batch: int, segment_len: int) -> int:
    """Segments per sequence of a step whose `tokens` per rank are `batch` sequences; 1 when segment_len is 0."""
    if batch < 1 or tokens % batch:
        raise ValueError(f"tokens per rank ({tokens}) must be a multiple of the batch ({batch})")
    if segment_len < 0:
        raise ValueError(f"model.segment_len={segment_len} must be >= 0 (0 = the whole sequence)")
    return -(-(tokens // batch) // segment_len) if segment_len else 1


def estimate_bytes(args: GLAArgs, tokens: int, shards: int, device_type: str, batch: int = 1,
                   segment_len: int = 0, plain: bool = False) -> dict:
    """Lower bounds, in bytes, of what one rank holds at the peak of a training step (see the module doc).
    tokens: per rank, `batch` sequences of tokens / batch; segment_len: tokens per segment (0 = no segments);
    plain: the module without FSDP (shards 1)."""
    n_seg = segments(tokens, batch, segment_len)
    live = tokens if n_seg == 1 else batch * segment_len  # what one forward with autograd holds
    elem = DTYPES[args.dtype].itemsize if device_type != "cuda" else 4
    act_elem = 2 if device_type == "cuda" else elem
    counts = count_params(args)
    states = counts["total"] * (3 if n_seg == 1 else 4) * elem / max(shards, 1)
    per_token_layer = args.dim if args.activation_checkpointing != "none" else 2 * args.dim + 3 * args.ffn_dim
    activations = live * args.n_layers * per_token_layer * act_elem
    logits = 0 if device_type == "cuda" else live * args.vocab_size * elem
    linear_layers = args.n_layers - len(softmax_layer_set(args))
    state_set = linear_layers * batch * args.key_dim * args.value_dim // args.n_heads * 4
    segment_states = n_seg * state_set if n_seg > 1 else 0  # n - 1 boundaries + the gradient in flight
    keeps = (args.gla_save_h and device_type == "cuda" and args.activation_checkpointing == "none"
             and args.attn_variant == "gla")
    kept_states = live // 64 * linear_layers * args.key_dim * args.value_dim // args.n_heads * 2 if keeps else 0
    copy_elem = (2 if args.float8 == "none" else 1) if plain and device_type == "cuda" else 0  # float8: 1 byte
    weight_copies = (counts["non_embedding"] + counts["head"]) * copy_elem
    parts = {"states": states, "activations": activations, "logits": logits, "segment_states": segment_states,
             "kept_states": kept_states, "weight_copies": weight_copies}
    return {**parts, "total": sum(parts.values())}


def available_bytes(device: torch.device) -> tuple[float, str] | None:
    """(bytes one rank may use, what they are), or None where this cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free memory of {torch.cuda.get_device_name(device)}"
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = float(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    what = "available RAM" + (f" / {local} ranks on this node" if local > 1 else "")
    return avail / max(local, 1), what


def shortfall(args: GLAArgs, tokens: int, shards: int, device: torch.device, batch: int = 1,
              segment_len: int = 0, plain: bool = False) -> str | None:
    """None when the estimate fits what the device has (or that cannot be read), else one line: the numbers and
    what to change. tokens: per rank (batch sequences); segment_len: tokens per rank per segment, 0 = the whole
    sequence; plain: the module without FSDP."""
    need = estimate_bytes(args, tokens, shards, device.type, batch, segment_len, plain)  # bad sizes fail anywhere
    have = available_bytes(device)
    if have is None or need["total"] <= have[0]:
        return None
    avail, what = have
    n = count_params(args)["total"]
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in need.items() if k != "total" and v)
    seg = f" in segments of {segment_len}" if segments(tokens, batch, segment_len) > 1 else ""
    return (f"this model ({n / 1e6:.1f}M parameters, {tokens} tokens per rank{seg}) needs at least "
            f"{need['total'] / GiB:.1f} GiB per rank ({parts}) but {device.type} has {avail / GiB:.1f} GiB ({what}): "
            f"use a smaller config (e.g. config=debug.yaml, or a smaller model.dim / model.n_layers / data.seq_len), "
            f"model.activation_checkpointing=full, model.segment_len (fewer tokens per segment), "
            f"{'model.gla_save_h=false, ' if need['kept_states'] else ''}more ranks to shard "
            f"over, or a device with more memory")


def check_fits(args: GLAArgs, tokens: int, shards: int, device: torch.device, batch: int = 1,
               segment_len: int = 0, plain: bool = False) -> None:
    """ValueError (shortfall's line) when the estimate exceeds what the device has."""
    if (why := shortfall(args, tokens, shards, device, batch, segment_len, plain)) is not None:
        raise ValueError(why)


def choose_fsdp(args, world: int, device: torch.device):
    """(args, why): the trainer's args (.model, .data, .distributed) with distributed.fsdp decided where it is
    null (auto), and one line saying what was decided and why. More than one process: FSDP shards. One
    process: nothing to shard, so the plain module, which skips FSDP's casts, copies and hooks; unless its
    weight copies would not fit, then FSDP, which gathers them a block at a time."""
    dist_args = args.distributed
    if dist_args.fsdp is not None:
        return args, f"distributed.fsdp={str(dist_args.fsdp).lower()} (as set)"
    if world > 1:
        fsdp, why = True, f"{world} processes share the parameters"
    else:
        tokens, batch = args.data.batch_size * args.data.seq_len, args.data.batch_size
        fsdp = shortfall(args.model, tokens, 1, device, batch, args.model.segment_len, plain=True) is not None
        why = ("one process, but the plain module's weight copies would not fit: FSDP gathers them block by block"
               if fsdp else "one process: nothing to shard, the plain module skips FSDP's casts and copies")
    resolved = dataclasses.replace(args, distributed=dataclasses.replace(dist_args, fsdp=fsdp))
    return resolved, f"distributed.fsdp={str(fsdp).lower()} (auto: {why})"


def decided_fsdp(args) -> bool:
    """args.distributed.fsdp once choose_fsdp has decided it; ValueError while it is still null (auto)."""
    if args.distributed.fsdp is None:
        raise ValueError("distributed.fsdp is null (auto): decide it with apps.gla.memory_fit.choose_fsdp first")
    return args.distributed.fsdp
