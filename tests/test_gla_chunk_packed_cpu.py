"""The staged single-device operator (lingua_zeco/kernels/gla_chunk.py) on packed documents, on CPU: its own code
over fla's stages written out in float64 (tests/fla_stages_cpu.py), called as lingua_zeco.kernels.chunk_gla calls
it (default options), with an initial state per document and a gradient at each document's final state, against
autograd through the token-by-token recurrence (naive_gla, float64). What it checks is what the operator hands
the packed state stages: each document's initial state forward, and each document's final-state gradient backward
(which reaches dh0, dq, dk, dv and dg)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lingua_zeco.kernels as kernels

import fla_stages_cpu

gla_chunk = pytest.importorskip("lingua_zeco.kernels.gla_chunk")  # needs fla and Triton importable

# four documents: a partial chunk, one across a chunk boundary of its own, a single token, one of two chunks
BOUNDS, H, K, V, SCALE = (0, 40, 140, 141, 230), 2, 8, 6, 0.3


def test_packed_documents_with_initial_states_and_final_state_gradients(monkeypatch):
    fla_stages_cpu.use_cpu_stages(monkeypatch, gla_chunk)
    monkeypatch.setattr(kernels, "pick_backend", lambda device, backend=None: "fla")  # the staged operator on CPU
    gen = torch.Generator().manual_seed(6)
    d = dict(generator=gen, dtype=torch.float64)
    T, N = BOUNDS[-1], len(BOUNDS) - 1
    q, k = (torch.randn(1, T, H, K, **d) for _ in range(2))
    v, do = (torch.randn(1, T, H, V, **d) for _ in range(2))
    g = F.logsigmoid(torch.randn(1, T, H, K, **d) + 3)  # long memory: h0 and dht reach far into each document
    h0, dht = torch.randn(N, H, K, V, **d), torch.randn(N, H, K, V, **d)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, h0)]
        o, ht = fn(*leaves[:4], scale=SCALE, initial_state=leaves[4], output_final_state=True,
                   cu_seqlens=torch.tensor(BOUNDS))
        return o.grad_fn.name(), [o.detach(), ht.detach(), *torch.autograd.grad((o, ht), leaves, (do, dht))]
    (node, got), (_, ref) = run(kernels.chunk_gla), run(kernels.naive_gla)
    assert "ChunkGLA" in node, node  # the staged operator ran, not the torch backend
    errs = {name: ((a - b).abs().max() / b.abs().max()).item()
            for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dh0"), got, ref, strict=True)}
    bad = {name: err for name, err in errs.items() if not err < 1e-9}
    assert not bad, f"relative errors: {bad}"
