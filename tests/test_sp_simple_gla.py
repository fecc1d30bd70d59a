"""Scalar-decay GLA (fla's chunk_simple_gla semantics, g [B, T, H]) through the same SP machinery:
kernel vs float64 oracle, and P = 2..4 gloo ranks vs single device vs the oracle, forward and
backward, every method; dropping the state (method local) must be caught."""
import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.comm import AllScanArgs
from lingua_zeco.kernels import chunk_simple_gla, naive_gla, naive_simple_gla
from lingua_zeco.sp import sp_simple_gla
from lingua_zeco.testing import run_on_ranks

B, H, K, V, T_LOCAL = 2, 2, 8, 4, 12


def global_inputs(P, B=B, seed=1):
    gen = torch.Generator().manual_seed(seed)
    T = P * T_LOCAL
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)  # [B, T, H]: one decay per head and token
    do = torch.randn(B, T, H, V, generator=gen)
    return q, k, v, g, do


def docs_for(P):
    T = P * T_LOCAL
    return torch.tensor(sorted({0, T, 5, T_LOCAL + 3, 2 * T_LOCAL, T - 2}))


def max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_oracle_is_gla_with_broadcast_decay_and_kernel_matches_it():
    q, k, v, g, do = (t.double() for t in global_inputs(3))
    h0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o64, ht64 = naive_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    o_gla, ht_gla = naive_gla(q, k, v, g[..., None].expand_as(q), initial_state=h0, output_final_state=True)
    assert max_rel(o64, o_gla) < 1e-6 and max_rel(ht64, ht_gla) < 1e-12
    q, k, v, g = (t.requires_grad_() for t in (q, k, v, g))
    o, ht = chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, backend="torch")
    assert max_rel(o, o64) < 1e-10 and max_rel(ht, ht64) < 1e-10
    # dg of the broadcast gate is summed over K by autograd: check it against finite differences
    assert torch.autograd.gradcheck(lambda g_: chunk_simple_gla(q[:1, :9], k[:1, :9], v[:1, :9], g_,
                                                                backend="torch")[0], (g[:1, :9],))
    cu = torch.tensor([0, 7, 20, 36])
    o_v, _ = chunk_simple_gla(q[:1].detach(), k[:1].detach(), v[:1].detach(), g[:1].detach(), cu_seqlens=cu,
                              backend="torch")
    assert max_rel(o_v, naive_simple_gla(q[:1], k[:1], v[:1], g[:1], cu_seqlens=cu)[0]) < 1e-10
    with pytest.raises(ValueError, match=r"g must be \[B, T, H\]"):
        chunk_simple_gla(q, k, v, g[..., None].expand_as(q), backend="torch")


VARIANTS = [("zeco", "chain", False), ("zeco", "tree", False), ("zeco", "chain", True),
            ("lasp1", "chain", False), ("lasp1", "chain", True), ("lasp2", "chain", False), ("lasp2", "chain", True),
            ("local", "chain", False)]


def _worker(rank, P):
    out = {}
    for method, algo, varlen in VARIANTS:
        b = 1 if varlen else B
        q, k, v, g, do = (t[:, rank * T_LOCAL:(rank + 1) * T_LOCAL] for t in global_inputs(P, B=b))
        q, k, v, g = (t.clone().requires_grad_() for t in (q, k, v, g))
        o = sp_simple_gla(q, k, v, g, method=method, cu_seqlens=docs_for(P) if varlen else None,
                          scan=AllScanArgs(algorithm=algo, n_blocks=3))
        (o * do).sum().backward()
        out[(method, algo, varlen)] = [o.detach(), q.grad, k.grad, v.grad, g.grad]
    return out


def single_device(P, varlen):
    q, k, v, g, do = global_inputs(P, B=1 if varlen else B)
    q, k, v, g = (t.clone().requires_grad_() for t in (q, k, v, g))
    cu = docs_for(P) if varlen else None
    o = sp_simple_gla(q, k, v, g, cu_seqlens=cu)  # no process group: P = 1, the variant's own kernel
    (o * do).sum().backward()
    return [o.detach(), q.grad, k.grad, v.grad, g.grad], naive_simple_gla(*(t.detach() for t in (q, k, v, g)),
                                                                          cu_seqlens=cu)[0]


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 3, 4])
def test_sp_simple_gla_equals_single_device(P):
    per_rank = run_on_ranks(_worker, P, timeout_s=240)
    refs = {vl: single_device(P, vl) for vl in (False, True)}
    for method, algo, varlen in VARIANTS:
        got = [torch.cat([r[(method, algo, varlen)][i] for r in per_rank], dim=1) for i in range(5)]
        ref, oracle = refs[varlen]
        assert got[4].shape == ref[4].shape == got[0].shape[:3]  # dg is per head, not per key channel
        errs = {name: max_rel(a, b) for name, a, b in zip("o dq dk dv dg".split(), got, ref)}
        errs["o_vs_fp64"] = max_rel(got[0], oracle)
        if method == "local":  # the broken variant must be caught by the same comparison
            assert errs["o"] > 1e-2 and errs["dg"] > 1e-2, f"dropping S_in went unnoticed: {errs}"
            continue
        bad = {n: e for n, e in errs.items() if e > 2e-5}
        assert not bad, f"simple_gla {method}/{algo}/varlen={varlen} at P={P} differs from single device: {bad}"


def test_bad_gate_shape():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"g must be \[B, T_local, H\]"):
        sp_simple_gla(q, q, q, q.clamp(max=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_simple_gla_matches_torch_on_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(torch.randn(2, 300, 4, generator=gen, device="cuda") + 3)
    q, k, v, g = (t.requires_grad_() for t in (q, k, v, g))
    h0 = torch.randn(2, 4, 64, 64, device="cuda")
    do = torch.randn_like(v)
    res = {}
    for backend in ("fla", "torch"):
        o, ht = chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True, backend=backend)
        res[backend] = [o, ht, *torch.autograd.grad((o.float() * do.float()).sum() + ht.sum(), (q, k, v, g))]
    for name, a, b in zip("o ht dq dk dv dg".split(), res["fla"], res["torch"]):
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 2e-2, f"{name}: relative error {rel:.3e}"
