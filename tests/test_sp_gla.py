"""sp_gla on P gloo ranks against single-device GLA and the float64 oracle, forward and backward."""
import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.comm import AllScanArgs
from lingua_zeco.kernels import naive_gla, torch_chunk_gla
from lingua_zeco.sp import sp_gla
from lingua_zeco.testing import run_on_ranks

B, H, K, V, T_LOCAL = 2, 2, 8, 4, 12


def global_inputs(P, B=B, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = P * T_LOCAL
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2)  # slow decay: states reach far across ranks
    do = torch.randn(B, T, H, V, generator=gen)
    return q, k, v, g, do


def docs_for(P):
    """Boundaries that cross ranks, fall inside one, and one exactly at a rank's first token."""
    T = P * T_LOCAL
    cuts = {0, T, 5, T_LOCAL + 3, 2 * T_LOCAL, T - 2}
    return torch.tensor(sorted(c for c in cuts if 0 <= c <= T))


VARIANTS_ALL = [  # (method, scan algorithm, varlen)
    ("zeco", "chain", False), ("zeco", "tree", False), ("zeco", "chain", True), ("zeco", "tree", True),
    ("zeco", "hier", False), ("zeco", "hier", True),
    ("lasp1", "chain", False), ("lasp1", "chain", True),
    ("lasp2", "chain", False), ("lasp2", "chain", True),
    ("local", "chain", False),
]
VARIANTS = VARIANTS_ALL


def _worker(rank, P):
    out = {}
    for method, algo, varlen in VARIANTS:
        b = 1 if varlen else B
        q, k, v, g, do = (t[:, rank * T_LOCAL:(rank + 1) * T_LOCAL] for t in global_inputs(P, B=b))
        q, k, v, g = (t.clone().requires_grad_() for t in (q, k, v, g))
        cu = docs_for(P) if varlen else None
        scan = AllScanArgs(algorithm=algo, n_blocks=3, node_size=2 if P % 2 == 0 else 1)
        o = sp_gla(q, k, v, g, method=method, cu_seqlens=cu, scan=scan)
        (o * do).sum().backward()
        out[(method, algo, varlen)] = [o.detach(), q.grad, k.grad, v.grad, g.grad]
    return out


def single_device(P, varlen):
    q, k, v, g, do = global_inputs(P, B=1 if varlen else B)
    q, k, v, g = (t.clone().requires_grad_() for t in (q, k, v, g))
    cu = docs_for(P) if varlen else None
    o, _ = torch_chunk_gla(q, k, v, g, cu_seqlens=cu)
    (o * do).sum().backward()
    o_oracle, _ = naive_gla(q.detach(), k.detach(), v.detach(), g.detach(), cu_seqlens=cu)
    return [o.detach(), q.grad, k.grad, v.grad, g.grad], o_oracle


def max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.slow
@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_sp_gla_equals_single_device(P):
    per_rank = run_on_ranks(_worker, P, timeout_s=240)
    refs = {vl: single_device(P, vl) for vl in (False, True)}
    for method, algo, varlen in VARIANTS:
        got = [torch.cat([r[(method, algo, varlen)][i] for r in per_rank], dim=1) for i in range(5)]
        ref, oracle = refs[varlen]
        errs = {name: max_rel(a, b) for name, a, b in zip("o dq dk dv dg".split(), got, ref)}
        errs["o_vs_fp64"] = max_rel(got[0], oracle)
        if method == "local" and P == 1:  # one rank: nothing to drop, so it must be exact too
            pass
        elif method == "local":  # the broken variant must be caught by the same comparison
            assert errs["o"] > 1e-2 and errs["dg"] > 1e-2, f"dropping S_in went unnoticed: {errs}"
            continue
        bad = {n: e for n, e in errs.items() if e > 2e-5}
        assert not bad, f"{method}/{algo}/varlen={varlen} at P={P} differs from single-device GLA: {bad}"


def _bad_worker(rank, P, case):
    q = torch.randn(1, T_LOCAL, H, K)
    v = torch.randn(1, T_LOCAL, H, V)
    if case == "heads" and rank == 1:
        q = torch.randn(1, T_LOCAL, H + 1, K)
        v = torch.randn(1, T_LOCAL, H + 1, V)
    g = F.logsigmoid(torch.randn_like(q))
    try:
        sp_gla(q, q, v, g, method="none" if case == "none" else "zeco")
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case,needle", [("heads", "disagree"), ("none", "method 'none'")])
def test_bad_input_is_one_clear_error(case, needle):
    msgs = run_on_ranks(_bad_worker, 2, case)
    assert all(needle in m for m in msgs), msgs


def test_local_input_errors():
    q = torch.randn(2, 8, 2, 4)
    with pytest.raises(ValueError, match="B = 1"):
        sp_gla(q, q, q, q.clamp(max=0), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="v must be"):
        sp_gla(q, q, q[:, :4], q.clamp(max=0))
    with pytest.raises(ValueError, match="method must be"):
        sp_gla(q, q, q, q.clamp(max=0), method="ring")
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        sp_gla(q[:1], q[:1], q[:1], q[:1].clamp(max=0), cu_seqlens=torch.tensor([0, 3, 9]))


# Issue 17: under the trainer's bf16 autocast the state correction ran in bf16 (its einsum is a bmm,
# which autocast casts). fp32 inputs under autocast must still give fp32-level results: a bf16
# correction misses this tolerance by orders of magnitude (bf16 carries 8 bits).
AUTOCAST_VARIANTS = [("zeco", "chain", False), ("zeco", "tree", True), ("zeco", "hier", False),
                     ("lasp1", "chain", True), ("lasp2", "chain", False), ("lasp2", "chain", True)]
AUTOCAST_TOL = 1e-5


def _autocast_worker(rank, P):
    out = {}
    for method, algo, varlen in AUTOCAST_VARIANTS:
        b = 1 if varlen else B
        q, k, v, g, do = (t[:, rank * T_LOCAL:(rank + 1) * T_LOCAL] for t in global_inputs(P, B=b, seed=1))
        q, k, v, g = (t.clone().requires_grad_() for t in (q, k, v, g))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o = sp_gla(q, k, v, g, method=method, cu_seqlens=docs_for(P) if varlen else None, fused=False,
                       scan=AllScanArgs(algorithm=algo, n_blocks=2, node_size=1))
        (o * do).sum().backward()  # outside autocast, as the trainer does
        out[(method, algo, varlen)] = [o.detach(), q.grad, k.grad, v.grad, g.grad]
    return out


def oracle_with_grads(P, varlen, seed):
    q, k, v, g, do = (t.double() for t in global_inputs(P, B=1 if varlen else B, seed=seed))
    q, k, v, g = (t.requires_grad_() for t in (q, k, v, g))
    o, _ = naive_gla(q, k, v, g, cu_seqlens=docs_for(P) if varlen else None)
    (o * do).sum().backward()
    return [o.detach(), q.grad, k.grad, v.grad, g.grad]


def test_sp_gla_under_bf16_autocast_keeps_fp32_state_and_correction():
    P = 3
    per_rank = run_on_ranks(_autocast_worker, P, timeout_s=180)
    oracles = {vl: oracle_with_grads(P, vl, seed=1) for vl in (False, True)}
    for method, algo, varlen in AUTOCAST_VARIANTS:
        got = [torch.cat([r[(method, algo, varlen)][i] for r in per_rank], dim=1) for i in range(5)]
        assert got[0].dtype == torch.float32
        errs = {n: max_rel(a, b) for n, a, b in zip("o dq dk dv dg".split(), got, oracles[varlen])}
        bad = {n: e for n, e in errs.items() if e > AUTOCAST_TOL}
        assert not bad, f"{method}/{algo}/varlen={varlen} under bf16 autocast is not fp32-exact: {bad}"


# Issue 17: zero-length documents (equal consecutive boundaries) crashed the torch backend. They must
# change nothing: the result equals that of the same sequence with them removed, gradients too.
def docs_with_empty(P):
    """Empty documents at the start, inside rank 0, at the rank boundary T_LOCAL, and at the end."""
    T = P * T_LOCAL
    return torch.tensor(sorted([0, 0, 5, 5, T_LOCAL, T_LOCAL, min(T_LOCAL + 3, T), T - 2, T, T]))


EMPTY_DOC_VARIANTS = [("zeco", "chain"), ("zeco", "tree"), ("lasp1", "chain"), ("lasp2", "chain")]


def _empty_docs_worker(rank, P):
    q, k, v, g, do = (t[:, rank * T_LOCAL:(rank + 1) * T_LOCAL] for t in global_inputs(P, B=1, seed=2))
    out = {}
    for method, algo in EMPTY_DOC_VARIANTS if P > 1 else [("none", "chain")]:
        for cu in (docs_with_empty(P), docs_with_empty(P).unique()):
            ins = [t.clone().requires_grad_() for t in (q, k, v, g)]
            o = sp_gla(*ins, method=method, cu_seqlens=cu, scan=AllScanArgs(algorithm=algo, n_blocks=2))
            (o * do).sum().backward()
            out.setdefault((method, algo), []).append([o.detach()] + [t.grad for t in ins])
    return out


@pytest.mark.parametrize("P", [1, 2, 3])
def test_zero_length_documents_change_nothing(P):
    per_rank = run_on_ranks(_empty_docs_worker, P, timeout_s=180) if P > 1 else [_empty_docs_worker(0, 1)]
    q, k, v, g, _ = global_inputs(P, B=1, seed=2)
    oracle, _ = naive_gla(q, k, v, g, cu_seqlens=docs_with_empty(P))
    for key in per_rank[0]:
        with_empty, without = ([torch.cat([r[key][j][i] for r in per_rank], dim=1) for i in range(5)]
                               for j in (0, 1))
        for name, a, b in zip("o dq dk dv dg".split(), with_empty, without):
            assert torch.equal(a, b), f"{key} at P={P}: {name} changes with empty documents"
        assert max_rel(with_empty[0], oracle) < 2e-5, f"{key} at P={P} differs from the oracle"
