"""The torch chunked backend against the float64 recurrence; fla against torch on a GPU (pytest -m gpu)."""
import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.kernels import GLAOptions, chunk_gla, naive_gla, pick_backend, torch_chunk_gla
from lingua_zeco.kernels import torch_chunk


def inputs(B=2, T=37, H=2, K=8, V=6, dtype=torch.float32, device="cpu", seed=0, strong=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, device=device, dtype=dtype)
    logits = torch.randn(B, T, H, K, generator=gen, device=device) * (4 if strong else 1)
    g = F.logsigmoid(logits - (4 if strong else 0)).to(dtype)
    return q, k, v, g


@pytest.mark.parametrize("T", [37, 5, 1])  # rows shorter than the chunk take a shorter one
@pytest.mark.parametrize("chunk", [4, 16])
@pytest.mark.parametrize("strong", [False, True])
def test_torch_chunk_matches_naive_with_states(chunk, strong, T, monkeypatch):
    monkeypatch.setattr(torch_chunk, "CHUNK", chunk)
    q, k, v, g = inputs(T=T, strong=strong)
    h0 = torch.randn(2, 2, 8, 6)
    o, ht = torch_chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
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


def test_backend_choice_inside_a_compiled_block():
    # compiled blocks ask for the backend on every trace: the answer is a constant there, Dynamo neither traces
    # fla's import nor warns about a cached function (it did, once per compile, on the GPU)
    import warnings

    def block(x):
        return x + (1.0 if pick_backend(torch.device("cuda")) == "fla" else 2.0)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(block, backend="eager", fullgraph=True)(torch.zeros(2))
    assert torch.equal(out, block(torch.zeros(2)))
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]


def test_operator_options_are_checked_and_reach_the_kernel():
    """A misspelt backend must not fall through to a default; the options' backend is the one that runs."""
    with pytest.raises(ValueError, match="GLA backend must be one of"):
        GLAOptions(backend="triton")
    q, k, v, g = inputs()
    with pytest.raises(RuntimeError, match="backend='torch'"):  # fla asked for on a CPU tensor
        GLAOptions(backend="fla").chunk_gla(q, k, v, g)
    assert torch.equal(GLAOptions(backend="torch", save_h=False).chunk_gla(q, k, v, g)[0], chunk_gla(q, k, v, g)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("varlen", [False, True])
def test_fla_matches_torch_backend_on_gpu(varlen):
    B = 1 if varlen else 2
    q, k, v, g = (t.requires_grad_()
                  for t in inputs(B=B, T=300, H=16, K=128, V=128, device="cuda", dtype=torch.bfloat16))
    cu = torch.tensor([0, 50, 129, 300], device="cuda") if varlen else None
    N = 3 if varlen else B
    h0 = torch.randn(N, 16, 128, 128, device="cuda")
    do = torch.randn_like(v)
    res = {}
    for backend in ("fla", "torch"):
        o, ht = GLAOptions(backend=backend).chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True,
                                                      cu_seqlens=cu)
        grads = torch.autograd.grad((o.float() * do.float()).sum() + ht.sum(), (q, k, v, g))
        res[backend] = [o, ht, *grads]
    for name, a, b in zip("o ht dq dk dv dg".split(), res["fla"], res["torch"]):
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 2e-2, f"{name}: relative error {rel:.3e}"


def test_torch_chunk_ignores_bf16_autocast():
    """The torch backend stands in for fla's kernels, which accumulate in fp32 whatever autocast says;
    under CPU bf16 autocast its matmuls were cast to bf16 (errors of ~1e-2)."""
    q, k, v, g = (t.requires_grad_() for t in inputs(T=21))
    h0 = torch.randn(2, 2, 8, 6)
    do = torch.randn(2, 21, 2, 6, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, ht = torch_chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    assert o.dtype == ht.dtype == torch.float32
    got = [o, ht, *torch.autograd.grad((o.double() * do).sum(), (q, k, v, g))]
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v, g)]
    o64, ht64 = naive_gla(*ins64, initial_state=h0, output_final_state=True)
    ref = [o64, ht64, *torch.autograd.grad((o64 * do).sum(), ins64)]
    for name, a, b in zip("o ht dq dk dv dg".split(), got, ref):
        rel = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert rel < 1e-5, f"{name}: {rel:.2e}"


def test_torch_chunk_zero_length_documents():
    """Empty documents (equal consecutive boundaries: at the start, inside, at the end) change nothing:
    the output and every gradient equal those of the same sequence without them, and an empty
    document's final state is its initial state (they once crashed in a reshape)."""
    q, k, v, g = inputs(B=1, T=33)
    cu_empty, cu_plain = torch.tensor([0, 0, 7, 7, 7, 20, 33, 33]), torch.tensor([0, 7, 20, 33])
    real, empty = [1, 4, 5], [0, 2, 3, 6]  # cu_empty's documents by length
    h0 = torch.randn(7, 2, 8, 6)
    do, dht = torch.randn(1, 33, 2, 6), torch.randn(3, 2, 8, 6)
    res = []
    for cu, h in ((cu_empty, h0), (cu_plain, h0[real])):
        ins = [t.clone().requires_grad_() for t in (q, k, v, g, h)]
        o, ht = torch_chunk_gla(*ins[:4], initial_state=ins[4], output_final_state=True, cu_seqlens=cu)
        ht_real = ht[real] if cu is cu_empty else ht
        grads = torch.autograd.grad((o * do).sum() + (ht_real * dht).sum(), ins)
        res.append((o, ht, grads))
    (o_e, ht_e, g_e), (o_p, ht_p, g_p) = res
    assert torch.equal(o_e, o_p) and torch.equal(ht_e[real], ht_p)
    assert torch.equal(ht_e[empty], h0[empty])  # nothing happened to the empty ones
    for name, a, b in zip("q k v g".split(), g_e, g_p):
        assert torch.equal(a, b), f"d{name} differs"
    assert torch.equal(g_e[4][real], g_p[4]) and g_e[4][empty].abs().max() == 0
    o_ref, _ = naive_gla(q, k, v, g, initial_state=h0, cu_seqlens=cu_empty)
    assert torch.allclose(o_e.double(), o_ref.double(), atol=1e-5)
