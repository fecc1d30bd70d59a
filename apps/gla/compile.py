"""model.compile and model.float8: the GLA model's blocks compiled by torch.compile, their linears in float8.

Compiled blocks (regional compilation, as torchtitan and fla's flame trainer do): every block calls one
compiled function of its computation (GLABlock.run; the block is an argument, its parameters are graph
inputs, so the 20 blocks of GLA-1B share one graph and compile once). Inductor fuses the norms, the forget
gate, SwiGLU, the residual adds and float8's scaling casts; the GLA operator is the opaque custom op
lingua_zeco.kernels.chunk_gla_op. FSDP2's hooks stay outside (they run around GLABlock.forward). Under
SP, with packed documents and for the other attention variants, the attention core runs outside the
graph (one graph break per block, torch.compiler.disable in lingua_zeco.sp).

float8 (torchao.float8): the block linears become Float8Linear with torchao's tensorwise or rowwise
recipe (dynamic scaling, e4m3); the low-rank forget-gate projections (rank 16) stay in bf16, the LM head
too unless model.float8_head. Off CUDA torchao emulates float8 (the CPU tests). Under FSDP on CUDA with the
tensorwise recipe, FSDP gathers those weights already cast to float8 (half the bytes of bf16), with every
scale computed at once after each optimizer step (torchao's float8 all-gather; gloo carries no float8).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn

from apps.gla.layers import GLAArgs
from apps.gla.model import GLABlock

MIN_FLOAT8_DIM = 64  # smaller GEMMs (the gate's rank-16 projections) cost more in casts than float8 saves


def compile_enabled(args: GLAArgs, device: torch.device, sp_size: int = 1) -> bool:
    """model.compile: blocks | none | auto: blocks on CUDA without sequence parallelism, where it was measured
    faster (docs/results/README.md, "History"); none on a CPU (compiling costs more than a short run saves) and
    under SP (the exchange breaks each block's graph; not measured on GPUs yet: model.compile=blocks asks)."""
    return args.compile == "blocks" or (args.compile == "auto" and device.type == "cuda" and sp_size == 1)


@functools.cache
def _compiled_run(backend: str, mode: str):
    # dynamic=False: a new sequence length recompiles rather than tracing symbolic sizes through the
    # custom op's chunk-size rule
    modes = dict(mode=mode) if backend == "inductor" and mode != "default" else {}  # other backends take none
    return torch.compile(GLABlock.run, backend=backend, dynamic=False, **modes)


def compile_blocks(blocks, backend: str = "inductor", mode: str = "default") -> None:
    """Every block's forward through one compiled function (backend, mode: torch.compile's; tests use
    aot_eager)."""
    fn = _compiled_run(backend, mode)
    for block in blocks:
        block.compiled = fn


def _float8_filter(head: bool):
    def keep(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear):
            return False
        if fqn == "lm_head":
            return head
        return min(mod.in_features, mod.out_features) >= MIN_FLOAT8_DIM and mod.in_features % 16 == 0 \
            and mod.out_features % 16 == 0
    return keep


def float8_all_gather(args: GLAArgs, fsdp: bool, device: torch.device) -> bool:
    """Whether FSDP gathers the float8 linears' weights in float8 (torchao's float8 all-gather: tensorwise
    only; NCCL, not gloo): half the bytes of a bf16 gather, the same float8 GEMM inputs up to rounding (the
    weights are cast from fp32 once instead of through bf16)."""
    return args.float8 == "tensorwise" and fsdp and device.type == "cuda"


def gathers_float8(model: nn.Module) -> bool:
    """Whether convert_float8 made any of the model's linears gather their weights in float8."""
    return any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False) for m in model.modules())


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step, with float8_all_gather: every float8 weight's scale from one amax all-reduce
    (else each all-gather computes its own)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def convert_float8(model: nn.Module, recipe: str, head: bool, device: torch.device,
                   all_gather: bool = False) -> list[str]:
    """Swap the chosen linears for torchao's Float8Linear (before FSDP wraps the model); all_gather: FSDP gathers
    their weights in float8 (float8_all_gather). Returns their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=all_gather)
    if device.type != "cuda":  # no float8 GEMMs here: torchao computes the same roundings in higher precision
        config = dataclasses.replace(config, emulate=True)
    keep = _float8_filter(head)
    names = [n for n, m in model.named_modules() if keep(m, n)]
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return names


def apply_speedups(model, args: GLAArgs, device: torch.device, sp_size: int = 1, fsdp: bool = False) -> dict:
    """model.float8, then model.compile, on a built model before FSDP (sp_size: the SP group's; fsdp: whether
    FSDP will wrap it). Returns what was applied."""
    done = dict(float8=[], compiled=False)
    if args.float8 != "none":
        done["float8"] = convert_float8(model, args.float8, args.float8_head, device,
                                        all_gather=float8_all_gather(args, fsdp, device))
    if compile_enabled(args, device, sp_size):
        compile_blocks(model.blocks, args.compile_backend, args.compile_mode)
        done["compiled"] = True
    return done


__all__ = ["apply_speedups", "compile_blocks", "compile_enabled", "convert_float8", "float8_all_gather",
           "gathers_float8", "precompute_float8_scales"]
