"""The torch chunked backend against the float64 recurrence; fla against torch on a GPU (pytest -m gpu)."""
import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.kernels import chunk_gla, naive_gla, pick_backend, torch_chunk_gla


def inputs(B=2, T=37, H=2, K=8, V=6, dtype=torch.float32, device="cpu", seed=0, strong=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, device=device, dtype=dtype)
    logits = torch.randn(B, T, H, K, generator=gen, device=device) * (4 if strong else 1)
    g = F.logsigmoid(logits - (4 if strong else 0)).to(dtype)
    return q, k, v, g


@pytest.mark.parametrize("chunk", [4, 16])
@pytest.mark.parametrize("strong", [False, True])
def test_torch_chunk_matches_naive_with_states(chunk, strong):
    q, k, v, g = inputs(strong=strong)
    h0 = torch.randn(2, 2, 8, 6)
    o, ht = torch_chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, chunk=chunk)
    o_ref, ht_ref = naive_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    assert torch.allclose(o.double(), o_ref.double(), atol=1e-5, rtol=1e-5)
    assert torch.allclose(ht.double(), ht_ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(o).all()


def test_torch_chunk_varlen_matches_naive():
    q, k, v, g = inputs(B=1, T=40)
    cu = torch.tensor([0, 7, 8, 30, 40])
    h0 = torch.randn(4, 2, 8, 6)
    o, ht = torch_chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = naive_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.allclose(o.double(), o_ref.double(), atol=1e-5)
    assert torch.allclose(ht.double(), ht_ref, atol=1e-5)
    # the oracle really resets at boundaries: ignoring them changes the answer
    o_joined, _ = naive_gla(q, k, v, g, initial_state=h0[:1])
    assert (o_joined[:, 7:] - o_ref[:, 7:]).abs().max() > 1e-2


def test_torch_chunk_gradients_match_naive():
    q, k, v, g = (t.double().requires_grad_() for t in inputs(T=21))
    h0 = torch.randn(2, 2, 8, 6, dtype=torch.float64, requires_grad=True)
    do = torch.randn(2, 21, 2, 6, dtype=torch.float64)
    dht = torch.randn(2, 2, 8, 6, dtype=torch.float64)
    grads = []
    for fn in (torch_chunk_gla, naive_gla):
        o, ht = fn(q, k, v, g, initial_state=h0, output_final_state=True)
        grads.append(torch.autograd.grad((o * do).sum() + (ht * dht).sum(), (q, k, v, g, h0)))
    for name, a, b in zip("q k v g h0".split(), *grads):
        assert torch.allclose(a, b, atol=1e-8), f"d{name} differs"


def test_backend_choice():
    assert pick_backend(torch.device("cpu")) == "torch"
    with pytest.raises(RuntimeError, match="backend='torch'"):
        pick_backend(torch.device("cpu"), "fla")
    with pytest.raises(ValueError, match="must be one of"):
        pick_backend(torch.device("cpu"), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("varlen", [False, True])
def test_fla_matches_torch_backend_on_gpu(varlen):
    B = 1 if varlen else 2
    q, k, v, g = (t.requires_grad_() for t in inputs(B=B, T=300, H=16, K=128, V=128, device="cuda", dtype=torch.bfloat16))
    cu = torch.tensor([0, 50, 129, 300], device="cuda") if varlen else None
    N = 3 if varlen else B
    h0 = torch.randn(N, 16, 128, 128, device="cuda")
    do = torch.randn_like(v)
    res = {}
    for backend in ("fla", "torch"):
        o, ht = chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend)
        grads = torch.autograd.grad((o.float() * do.float()).sum() + ht.sum(), (q, k, v, g))
        res[backend] = [o, ht, *grads]
    for name, a, b in zip("o ht dq dk dv dg".split(), res["fla"], res["torch"]):
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 2e-2, f"{name}: relative error {rel:.3e}"
