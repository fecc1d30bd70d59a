"""GLA compute backends behind one call: `chunk_gla(q, k, v, g, ...) -> (o, final_state)`.

* "fla":   fla's Triton kernels (CUDA). Fast; its internal stages are used by lingua_zeco.sp's fused ZeCO.
* "torch": pure PyTorch chunked GLA (any device, fp32 inside, autograd).
* oracle:  lingua_zeco.kernels.naive.naive_gla, float64 token by token.
`chunk_simple_gla` is the scalar-decay variant (g [B, T, H]; fla's chunk_simple_gla / RetNet style),
oracle naive_simple_gla.

The backend follows the device (CUDA with fla importable → fla, otherwise torch); force one with
`backend=` or the environment variable LINGUA_ZECO_GLA_BACKEND.
"""
from __future__ import annotations

import functools
import os

import torch

from .naive import naive_gla, naive_simple_gla
from .torch_chunk import torch_chunk_gla

BACKENDS = ("fla", "torch")


@functools.lru_cache(maxsize=1)
def fla_available() -> bool:
    try:
        import fla.ops.gla  # noqa: F401
    except Exception:  # ImportError, or Triton refusing this platform
        return False
    return torch.cuda.is_available()


def pick_backend(device: torch.device, backend: str | None = None) -> str:
    backend = backend or os.environ.get("LINGUA_ZECO_GLA_BACKEND") or None
    if backend is None:
        return "fla" if device.type == "cuda" and fla_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"GLA backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "fla" and not (device.type == "cuda" and fla_available()):
        raise RuntimeError("GLA backend 'fla' needs a CUDA tensor and an importable fla (pip install "
                           "flash-linear-attention); use backend='torch' on this machine")
    return backend


def chunk_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, backend: str | None = None):
    """GLA over [B, T, H, *] tensors with fla's contract; returns (o, final_state or None)."""
    name = pick_backend(q.device, backend)
    if name == "fla":
        from fla.ops.gla import chunk_gla as fla_chunk_gla
        return fla_chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return torch_chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_simple_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, backend: str | None = None):
    """Scalar-decay GLA (fla's chunk_simple_gla): g [B, T, H], one log decay per head and token.
    fla: its chunk_simple_gla kernel; torch: the GLA kernel with the decay broadcast over K (exact)."""
    if g.shape != q.shape[:3]:
        raise ValueError(f"simple GLA: g must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(g.shape)}")
    name = pick_backend(q.device, backend)
    if name == "fla":
        from fla.ops.simple_gla import chunk_simple_gla as fla_chunk_simple_gla
        return fla_chunk_simple_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return torch_chunk_gla(q, k, v, g[..., None].expand_as(q), scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)


__all__ = ["BACKENDS", "chunk_gla", "chunk_simple_gla", "fla_available", "naive_gla", "naive_simple_gla",
           "pick_backend", "torch_chunk_gla"]
