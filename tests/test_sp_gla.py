"""sp_gla on P gloo ranks against single-device GLA and the float64 oracle, forward and backward."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lingua_zeco.comm import AllScanArgs
from lingua_zeco.kernels import naive_gla, torch_chunk_gla
from lingua_zeco.sp import SPContext, sp_gla
from local_ranks import run_on_ranks
from sp_harness import (autocast_worker, docs_for, docs_with_empty, empty_docs_worker, expect_all_close,
                        expect_matches_reference, expect_pairs_equal, fwd_bwd, gla_inputs, on_ranks, rank_results)

B, H, K, V, T_LOCAL = 2, 2, 8, 4, 12


def global_inputs(P, B=B, seed=0):
    return gla_inputs(P, T_LOCAL, B, H, K, V, seed)  # q, k, v, g [B, T, H, K], do


VARIANTS_ALL = [  # (method, scan algorithm, varlen)
    ("zeco", "chain", False), ("zeco", "tree", False), ("zeco", "chain", True), ("zeco", "tree", True),
    ("zeco", "hier", False), ("zeco", "hier", True),
    ("lasp1", "chain", False), ("lasp1", "chain", True),
    ("lasp2", "chain", False), ("lasp2", "chain", True),
    ("local", "chain", False),
]
VARIANTS = VARIANTS_ALL


NAMES = "o dq dk dv dg".split()


def _worker(rank, P):
    def run(variant, q, k, v, g):
        method, algo, varlen = variant
        scan = AllScanArgs(algorithm=algo, n_blocks=3, node_size=2 if P % 2 == 0 else 1)
        return sp_gla(q, k, v, g, sp=SPContext(method=method, scan=scan),
                      cu_seqlens=docs_for(P, T_LOCAL) if varlen else None)
    return rank_results(rank, T_LOCAL, VARIANTS, lambda variant: global_inputs(P, B=1 if variant[2] else B), run)


def single_device(P, varlen):
    q, k, v, g, do = global_inputs(P, B=1 if varlen else B)
    cu = docs_for(P, T_LOCAL) if varlen else None
    ref = fwd_bwd(lambda *x: torch_chunk_gla(*x, cu_seqlens=cu)[0], (q, k, v, g), do)
    o_oracle, _ = naive_gla(q, k, v, g, cu_seqlens=cu)
    return ref, o_oracle


@pytest.mark.slow
@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_sp_gla_equals_single_device(P):
    per_rank = run_on_ranks(_worker, P, timeout_s=240)
    refs = {vl: single_device(P, vl) for vl in (False, True)}
    # local drops S_in: the same comparison must catch it (one rank: nothing to drop, it must be exact too)
    expect_matches_reference(per_rank, VARIANTS, refs, NAMES, 2e-5, f"sp_gla at P={P} vs single-device GLA",
                             broken=lambda variant: variant[0] == "local" and P > 1)


def _bad_worker(rank, P, case):
    q = torch.randn(1, T_LOCAL, H, K)
    v = torch.randn(1, T_LOCAL, H, V)
    if case == "heads" and rank == 1:
        q = torch.randn(1, T_LOCAL, H + 1, K)
        v = torch.randn(1, T_LOCAL, H + 1, V)
    g = F.logsigmoid(torch.randn_like(q))
    try:
        sp_gla(q, q, v, g, sp=SPContext(method="none" if case == "none" else "zeco"))
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
        sp_gla(q, q, q, q.clamp(max=0), sp=SPContext(method="ring"))
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        sp_gla(q[:1], q[:1], q[:1], q[:1].clamp(max=0), cu_seqlens=torch.tensor([0, 3, 9]))


# Under the trainer's bf16 autocast the state correction ran in bf16 (its einsum is a bmm,
# which autocast casts). fp32 inputs under autocast must still give fp32-level results: a bf16
# correction misses this tolerance by orders of magnitude (bf16 carries 8 bits).
AUTOCAST_VARIANTS = [("zeco", "chain", False), ("zeco", "tree", True), ("zeco", "hier", False),
                     ("lasp1", "chain", True), ("lasp2", "chain", False), ("lasp2", "chain", True)]
AUTOCAST_TOL = 1e-5


def composed_sp_gla(*ins, sp: SPContext, cu_seqlens):
    """sp_gla composed of whole kernels (SPContext.fused=False), the path the CPU runs anyway; named so that
    the test says which path it checks."""
    return sp_gla(*ins, sp=dataclasses.replace(sp, fused=False), cu_seqlens=cu_seqlens)


def oracle_with_grads(P, varlen, seed):
    *ins, do = (t.double() for t in global_inputs(P, B=1 if varlen else B, seed=seed))
    return fwd_bwd(lambda *x: naive_gla(*x, cu_seqlens=docs_for(P, T_LOCAL) if varlen else None)[0], ins, do)


def test_sp_gla_under_bf16_autocast_keeps_fp32_state_and_correction():
    P = 3
    inputs = {vl: global_inputs(P, B=1 if vl else B, seed=1) for vl in (False, True)}
    per_rank = run_on_ranks(autocast_worker, P, composed_sp_gla, inputs, docs_for(P, T_LOCAL),
                            AUTOCAST_VARIANTS, T_LOCAL, timeout_s=180)
    oracles = {vl: oracle_with_grads(P, vl, seed=1) for vl in (False, True)}
    expect_all_close(per_rank, AUTOCAST_VARIANTS, lambda variant: oracles[variant[2]], NAMES, AUTOCAST_TOL,
                     "sp_gla under bf16 autocast vs the float64 oracle:", dtype=torch.float32)


# Zero-length documents (equal consecutive boundaries) once crashed the torch backend. They must
# change nothing: the result equals that of the same sequence with them removed, gradients too.
EMPTY_DOC_VARIANTS = [("zeco", "chain"), ("zeco", "tree"), ("lasp1", "chain"), ("lasp2", "chain")]


@pytest.mark.parametrize("P", [1, 2, 3])
def test_zero_length_documents_change_nothing(P):
    inputs = global_inputs(P, B=1, seed=2)
    docs = docs_with_empty(P, T_LOCAL, inside=5, after=3, before_end=2)
    per_rank = on_ranks(empty_docs_worker, P, sp_gla, inputs, docs, EMPTY_DOC_VARIANTS, T_LOCAL, timeout_s=180)
    oracle, _ = naive_gla(*inputs[:-1], cu_seqlens=docs)  # all but do
    expect_pairs_equal(per_rank, NAMES, oracle, 2e-5, f"at P={P} with and without empty documents")
