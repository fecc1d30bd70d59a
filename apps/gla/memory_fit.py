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

Compared with what this machine can give one rank: CPU: MemAvailable / the ranks on this node;
CUDA: the free memory of the rank's device.
"""
from __future__ import annotations

import os

import torch

from apps.gla.layers import GLAArgs
from apps.gla.model import DTYPES, count_params

GiB = float(1 << 30)


def estimate_bytes(args: GLAArgs, tokens: int, shards: int, device_type: str) -> dict:
    """Lower bounds, in bytes, of what one rank holds at the peak of a training step (see the module doc)."""
    elem = DTYPES[args.dtype].itemsize if device_type != "cuda" else 4
    act_elem = 2 if device_type == "cuda" else elem
    states = count_params(args)["total"] * 3 * elem / max(shards, 1)
    per_token_layer = args.dim if args.activation_checkpointing != "none" else 2 * args.dim + 3 * args.ffn_dim
    activations = tokens * args.n_layers * per_token_layer * act_elem
    logits = 0 if device_type == "cuda" else tokens * args.vocab_size * elem
    return {"states": states, "activations": activations, "logits": logits,
            "total": states + activations + logits}


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


def check_fits(args: GLAArgs, tokens: int, shards: int, device: torch.device) -> None:
    """ValueError (one line, the numbers and what to change) when the estimate exceeds what the device has."""
    have = available_bytes(device)
    if have is None:
        return
    avail, what = have
    need = estimate_bytes(args, tokens, shards, device.type)
    if need["total"] <= avail:
        return
    n = count_params(args)["total"]
    parts = ", ".join(f"{k} {need[k] / GiB:.1f}" for k in ("states", "activations", "logits") if need[k])
    raise ValueError(
        f"this model ({n / 1e6:.1f}M parameters, {tokens} tokens per rank) needs at least {need['total'] / GiB:.1f} "
        f"GiB per rank ({parts}) but {device.type} has {avail / GiB:.1f} GiB ({what}): use a smaller config "
        f"(e.g. config=debug.yaml, or a smaller model.dim / model.n_layers / data.seq_len), "
        f"model.activation_checkpointing=full, more ranks to shard over, or a device with more memory")
