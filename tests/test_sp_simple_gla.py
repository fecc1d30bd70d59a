"""Scalar-decay GLA (fla's chunk_simple_gla semantics, g [B, T, H]) through the same SP machinery:
kernel vs float64 oracle, and P = 2..4 gloo ranks vs single device vs the oracle, forward and
backward, every method; dropping the state (method local) must be caught."""
import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.comm import AllScanArgs
from lingua_zeco.kernels import GLAOptions, naive_gla, naive_simple_gla
from lingua_zeco.sp import SPContext, sp_simple_gla
from local_ranks import run_on_ranks
from sp_harness import (docs_for, expect_matches_reference, fwd_bwd, gather, gla_inputs, grads_or_skip, max_rel,
                        rank_results)

B, H, K, V, T_LOCAL = 2, 2, 8, 4, 12

TORCH = GLAOptions(backend="torch")


def global_inputs(P, B=B, seed=1):
    return gla_inputs(P, T_LOCAL, B, H, K, V, seed, gate_per_key=False)  # g [B, T, H]: one decay per head and token


def test_oracle_is_gla_with_broadcast_decay_and_kernel_matches_it():
    q, k, v, g, do = (t.double() for t in global_inputs(3))
    h0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o64, ht64 = naive_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    o_gla, ht_gla = naive_gla(q, k, v, g[..., None].expand_as(q), initial_state=h0, output_final_state=True)
    assert max_rel(o64, o_gla) < 1e-6 and max_rel(ht64, ht_gla) < 1e-12
    q, k, v, g = (t.requires_grad_() for t in (q, k, v, g))
    o, ht = TORCH.chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    assert max_rel(o, o64) < 1e-10 and max_rel(ht, ht64) < 1e-10
    # dg of the broadcast gate is summed over K by autograd: check it against finite differences
    assert torch.autograd.gradcheck(lambda g_: TORCH.chunk_simple_gla(q[:1, :9], k[:1, :9], v[:1, :9], g_)[0],
                                    (g[:1, :9],))
    cu = torch.tensor([0, 7, 20, 36])
    o_v, _ = TORCH.chunk_simple_gla(q[:1].detach(), k[:1].detach(), v[:1].detach(), g[:1].detach(), cu_seqlens=cu)
    assert max_rel(o_v, naive_simple_gla(q[:1], k[:1], v[:1], g[:1], cu_seqlens=cu)[0]) < 1e-10
    with pytest.raises(ValueError, match=r"g must be \[B, T, H\]"):
        TORCH.chunk_simple_gla(q, k, v, g[..., None].expand_as(q))


VARIANTS = [("zeco", "chain", False), ("zeco", "tree", False), ("zeco", "chain", True),
            ("lasp1", "chain", False), ("lasp1", "chain", True), ("lasp2", "chain", False), ("lasp2", "chain", True),
            ("local", "chain", False)]


NAMES = "o dq dk dv dg".split()


def _worker(rank, P):
    def run(variant, q, k, v, g):
        method, algo, varlen = variant
        return sp_simple_gla(q, k, v, g, sp=SPContext(method=method, scan=AllScanArgs(algorithm=algo, n_blocks=3)),
                             cu_seqlens=docs_for(P, T_LOCAL) if varlen else None)
    return rank_results(rank, T_LOCAL, VARIANTS, lambda variant: global_inputs(P, B=1 if variant[2] else B), run)


def single_device(P, varlen):
    q, k, v, g, do = global_inputs(P, B=1 if varlen else B)
    cu = docs_for(P, T_LOCAL) if varlen else None
    # no process group: P = 1, the variant's own kernel
    ref = fwd_bwd(lambda *x: sp_simple_gla(*x, cu_seqlens=cu), (q, k, v, g), do)
    return ref, naive_simple_gla(q, k, v, g, cu_seqlens=cu)[0]


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 3, 4])
def test_sp_simple_gla_equals_single_device(P):
    per_rank = run_on_ranks(_worker, P, timeout_s=240)
    refs = {vl: single_device(P, vl) for vl in (False, True)}
    for variant in VARIANTS:  # dg is per head, not per key channel
        o, *_, dg = gather(per_rank, variant)
        assert dg.shape == refs[variant[2]][0][4].shape == o.shape[:3], variant
    # local drops S_in: the same comparison must catch it
    expect_matches_reference(per_rank, VARIANTS, refs, NAMES, 2e-5, f"sp_simple_gla at P={P} vs single device",
                             broken=lambda variant: variant[0] == "local")


def test_one_rank_hands_the_kernel_no_zero_length_document(monkeypatch):
    """Packed documents with zero-length ones (equal consecutive boundaries) on one rank: the kernel (fla's
    chunk_simple_gla on CUDA) gets the boundaries without them, as sp_gla's, and the output is the oracle's."""
    seen, kernel = [], GLAOptions.chunk_simple_gla  # sp/gla.py calls the context's options at each call

    def recording(self, *a, cu_seqlens=None, **kw):  # the real kernel, its boundaries noted
        cu = getattr(cu_seqlens, "cu_seqlens", cu_seqlens)  # a tensor, or the planned LocalSegments
        seen.append(None if cu is None else cu.tolist())
        return kernel(self, *a, cu_seqlens=cu_seqlens, **kw)

    monkeypatch.setattr(GLAOptions, "chunk_simple_gla", recording)
    q, k, v, g, _ = gla_inputs(1, 24, 1, H, K, V, seed=3, gate_per_key=False)
    o = sp_simple_gla(q, k, v, g, cu_seqlens=[0, 0, 5, 5, 5, 17, 24, 24])
    assert seen == [[0, 5, 17, 24]]
    ref = naive_simple_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 5, 17, 24]))[0]
    assert max_rel(o, ref) < 1e-5


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
    res = {b: list(GLAOptions(backend=b).chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True))
           for b in ("fla", "torch")}

    def check(names):
        for name, a, b in zip(names, res["fla"], res["torch"]):
            rel = (a.float() - b.float()).norm() / b.float().norm()
            assert rel < 2e-2, f"{name}: relative error {rel:.3e}"

    check(["o", "ht"])  # fla's backward may refuse this stack (grads_or_skip): the forward is checked first
    for backend in ("fla", "torch"):
        o, ht = res[backend]
        res[backend] += grads_or_skip(lambda o=o, ht=ht: torch.autograd.grad((o.float() * do.float()).sum() + ht.sum(),
                                                                            (q, k, v, g)))
    check("o ht dq dk dv dg".split())
