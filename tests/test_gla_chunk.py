"""The staged single-device operator (lingua_zeco/kernels/gla_chunk.py) keeps the contract fla's own
wrapper keeps for its kernels: every tensor a stage receives is contiguous, whatever autograd or the
caller hands in (an expanded final-state gradient from `ht.sum()`, a transposed initial state). fla's
kernels read memory as if it were contiguous, so a stride-0 gradient became garbage on the GPU (run 32,
docs/results/gpu_tests.md). Here, on CPU, fla's stages are replaced by recorders that check their inputs
and return zeros of the right shapes: the stages' numerics are tested on the GPU (tests/test_gpu_intra.py)."""
import pytest
import torch

gla_chunk = pytest.importorskip("lingua_zeco.kernels.gla_chunk")  # needs fla and Triton importable


def _recording_stages(monkeypatch, B, T, H, K, V, BT):
    seen = []
    NT = -(-T // BT)

    def stage(name, result):
        def run(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
            seen.append((name, all(t.is_contiguous() for t in tensors)))
            return result(*args, **kwargs)
        monkeypatch.setattr(gla_chunk.fla, name, run)

    z = torch.zeros
    stage("gate_cumsum", lambda g, *a, **kw: g.float())
    stage("chunk_fwd_h", lambda **kw: (z(B, NT, H, K, V), z(B, H, K, V) if kw["output_final_state"] else None))
    stage("chunk_gla_fwd_intra_gk", lambda **kw: z(B, T, H, BT))
    stage("chunk_gla_fwd_o_gk", lambda **kw: z(B, T, H, V))
    stage("chunk_bwd_dh", lambda **kw: (z(B, NT, H, K, V), None if kw["h0"] is None else z(B, H, K, V)))
    stage("chunk_gla_bwd_dv", lambda **kw: z(B, T, H, V))
    stage("chunk_gla_bwd_dA", lambda **kw: z(B, T, H, BT))
    stage("chunk_gla_bwd_dqkg", lambda **kw: (z(B, T, H, K), z(B, T, H, K), z(B, T, H, K)))
    seen_intra = []

    def intra(q, k, g_cs, dA, BT, **kw):
        seen_intra.append(all(t.is_contiguous() for t in (q, k, g_cs, dA)))
        return z(B, T, H, K), z(B, T, H, K)
    monkeypatch.setattr(gla_chunk, "chunk_gla_bwd_dqk_intra", intra)
    return seen, seen_intra


def test_every_stage_receives_contiguous_tensors(monkeypatch):
    """(Before the fix this failed: chunk_fwd_h got the transposed h0, chunk_bwd_dh both.)"""
    B, T, H, K, V = 2, 40, 2, 8, 8
    seen, seen_intra = _recording_stages(monkeypatch, B, T, H, K, V, gla_chunk.fla_chunk_size(T))
    q, k, g = (torch.randn(B, T, H, K, requires_grad=True) for _ in range(3))
    v = torch.randn(B, T, H, V, requires_grad=True)
    h0 = torch.randn(B, H, V, K).transpose(-1, -2).requires_grad_()  # a non-contiguous [B, H, K, V] view
    o, ht = gla_chunk.chunk_gla_staged(q, k, v, g, initial_state=h0, output_final_state=True)
    (o.sum() + ht.sum()).backward()  # ht.sum(): its gradient is ones expanded, stride 0
    names = {name for name, _ in seen}
    assert {"chunk_fwd_h", "chunk_bwd_dh", "chunk_gla_bwd_dqkg"} <= names and seen_intra == [True]
    assert [name for name, ok in seen if not ok] == []
