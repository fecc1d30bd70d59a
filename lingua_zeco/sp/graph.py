"""SP entry points inside torch.compile'd code (model.compile=blocks): what Inductor cannot compile — the
exchange between ranks, host-planned document tables, fla's autotuned kernels — runs outside the graph."""
from __future__ import annotations

import functools

import torch


def outside_graph(fn):
    """`fn` as it is in eager code; inside torch.compile'd code, called outside the graph (one graph break)."""
    outside = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return outside(*args, **kwargs) if torch.compiler.is_compiling() else fn(*args, **kwargs)
    return wrapper
