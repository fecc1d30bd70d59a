"""Gated DeltaNet through the SP machinery (lingua_zeco/kernels/delta.py, lingua_zeco/sp/delta.py):
the torch kernel vs the float64 oracle (and fla's own CPU reference for the convention), the matrix
pair scan, and P = 1, 2, 4 gloo ranks vs single device vs the oracle, outputs and the gradients of
q, k, v, g, β, every method; dropping S_in (local) or M (without_transition) must be caught. Then the
model variant: sp_size 2 trains exactly as sp_size 1."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import lingua_zeco.kernels.delta as kdelta
import lingua_zeco.sp.delta as spd
from lingua_zeco.comm import AllScanArgs, pair_scan
from lingua_zeco.kernels.delta import DeltaOptions, chunk_gated_delta, l2norm, naive_gated_delta
from lingua_zeco.sp import SPContext, sp_gated_delta
from local_ranks import run_on_ranks
from sp_harness import (autocast_worker, docs_with_empty, empty_docs_worker, expect_all_close, expect_close,
                        expect_equal, expect_matches_reference, expect_pairs_equal, fwd_bwd, grads_or_skip, max_rel,
                        on_ranks, rank_results, rel_errors)

B, H, K, V, T_LOCAL = 2, 2, 6, 4, 20
TORCH = DeltaOptions(backend="torch")


def global_inputs(P, B=B, seed=3, T=None):
    gen = torch.Generator().manual_seed(seed)
    T = T or P * T_LOCAL
    q = torch.randn(B, T, H, K, generator=gen)
    k = l2norm(torch.randn(B, T, H, K, generator=gen))  # the model's keys are L2-normalised
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3)  # mild decay: the state must travel far
    beta = torch.rand(B, T, H, generator=gen) * 0.9 + 0.05
    do = torch.randn(B, T, H, V, generator=gen)
    return q, k, v, g, beta, do


def docs_for(P):
    T = P * T_LOCAL
    return torch.tensor(sorted({0, 7, T_LOCAL, T_LOCAL + 5, T - 3, T}))  # one starts at a rank boundary


# ----------------------------------------------------------------------------- kernel

def test_oracle_matches_fla_reference_convention():
    """fla's own (fp32, CPU) recurrent reference: same argument order (…, beta, g), scale and
    state layout [N, H, K, V] as our oracle."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    q, k, v, g, beta, _ = (t.double() for t in global_inputs(2))
    h0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o, ht = naive_gated_delta(q, k, v, (g, beta), scale=0.7, initial_state=h0, output_final_state=True)
    o_f, ht_f = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=0.7, initial_state=h0, output_final_state=True)
    assert max_rel(o_f, o) < 1e-5 and max_rel(ht_f, ht) < 1e-5


def test_torch_kernel_matches_oracle_forward_backward_varlen(monkeypatch):
    q, k, v, g, beta, do = (t.double() for t in global_inputs(1, T=77))  # not a multiple of the chunk
    h0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o64, ht64 = naive_gated_delta(q, k, v, (g, beta), initial_state=h0, output_final_state=True)
    o, ht = TORCH.chunk_gated_delta(q, k, v, (g, beta), initial_state=h0, output_final_state=True)
    assert max_rel(o, o64) < 1e-10 and max_rel(ht, ht64) < 1e-10
    # gradients of every input (and of the initial state) against finite differences
    short = [t[:1, :7, :1].clone().requires_grad_() for t in (q, k, v, g, beta)] + [h0[:1, :1].clone().requires_grad_()]
    with monkeypatch.context() as m:
        m.setattr(kdelta, "CHUNK", 4)  # 7 tokens: two chunks, the hand-over between them differentiated too
        assert torch.autograd.gradcheck(
            lambda q_, k_, v_, g_, b_, h_: TORCH.chunk_gated_delta(q_, k_, v_, (g_, b_), initial_state=h_,
                                                                   output_final_state=True), short)
    cu = torch.tensor([0, 9, 40, 77])
    hs = torch.randn(3, H, K, V, dtype=torch.float64)
    o_v, ht_v = TORCH.chunk_gated_delta(q[:1], k[:1], v[:1], (g[:1], beta[:1]), cu_seqlens=cu, initial_state=hs,
                                        output_final_state=True)
    o_n, ht_n = naive_gated_delta(q[:1], k[:1], v[:1], (g[:1], beta[:1]), cu_seqlens=cu, initial_state=hs,
                                  output_final_state=True)
    assert max_rel(o_v, o_n) < 1e-10 and max_rel(ht_v, ht_n) < 1e-10


def test_widened_pass_gives_transition_matrix():
    """[v | 0] from [0 | I] returns the product of the transitions: S_out = M S_in + S_loc for any S_in."""
    q, k, v, g, beta, _ = (t.double() for t in global_inputs(1))
    v_wide = torch.cat([v, torch.zeros(*v.shape[:3], K, dtype=v.dtype)], -1)
    h0 = torch.cat([torch.zeros(B, H, K, V, dtype=v.dtype), torch.eye(K, dtype=v.dtype).expand(B, H, K, K)], -1)
    _, S_wide = TORCH.chunk_gated_delta(q, k, v_wide, (g, beta), initial_state=h0, output_final_state=True)
    S_in = torch.randn(B, H, K, V, dtype=torch.float64)
    _, S_out = naive_gated_delta(q, k, v, (g, beta), initial_state=S_in, output_final_state=True)
    assert max_rel(S_wide[..., V:] @ S_in + S_wide[..., :V], S_out) < 1e-12


def test_bad_inputs():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"beta must be \[B, T, H\]"):
        sp_gated_delta(q, q, q, q[..., 0].clamp(max=0), q)
    with pytest.raises(ValueError, match=r"g must be \[B, T, H\]"):
        chunk_gated_delta(q, q, q, (q, q[..., 0]))
    with pytest.raises(ValueError, match=r"gates must be the pair \(g, beta\)"):
        chunk_gated_delta(q, q, q, q[..., 0])
    with pytest.raises(ValueError, match="method must be one of"):
        sp_gated_delta(q, q, q, q[..., 0], q[..., 0].sigmoid(), sp=SPContext(method="ring"))


# ----------------------------------------------------------------------------- SP on gloo ranks

VARIANTS = [("zeco", "chain", False), ("zeco", "tree", False), ("zeco", "auto", False),
            ("zeco", "chain", True), ("zeco", "tree", True),
            ("lasp1", "chain", False), ("lasp1", "chain", True), ("lasp2", "chain", False), ("lasp2", "chain", True),
            ("local", "chain", False), ("zeco_no_M", "chain", False)]


def _scan_worker(rank, P):
    """pair_scan forward and reverse against the serial recurrence, with 1 and 3 blocks."""
    torch.manual_seed(0)
    xs, As = torch.randn(P, 2, 3, 5, dtype=torch.float64), torch.randn(P, 2, 3, 3, dtype=torch.float64) * 0.7
    out = {}
    for algo, nb in (("chain", 1), ("chain", 3), ("tree", 0)):
        args = AllScanArgs(algorithm=algo, n_blocks=nb)
        out[algo, nb] = (pair_scan(xs[rank], As[rank], args=args),
                         pair_scan(xs[rank], As[rank], reverse=True, args=args))
    return xs, As, out


def check_pair_scan(res):
    """The ranks' pair_scan results (from _scan_worker) against the serial recurrence."""
    P = len(res)
    xs, As, _ = res[0]
    fwd, y = [], torch.zeros_like(xs[0])
    for p in range(P):
        fwd.append(y)
        y = As[p] @ y + xs[p]
    rev, y = [None] * P, torch.zeros_like(xs[0])
    for p in reversed(range(P)):
        rev[p] = y
        y = As[p] @ y + xs[p]
    for rank, (_, _, out) in enumerate(res):
        for key, (f, r) in out.items():
            assert max_rel(f, fwd[rank]) < 1e-12 if rank else f.abs().max() == 0, key
            assert max_rel(r, rev[rank]) < 1e-12 if rank < P - 1 else r.abs().max() == 0, key


@contextlib.contextmanager
def without_transition(drop: bool):
    """Broken on purpose when `drop`: the combine forgets M (S_in(p+1) = S_loc(p)), as if the widened pass
    returned no transition."""
    saved = spd._widened_pass

    def forgetful(*args, **kwargs):
        o_loc, q_tilde, S_loc, M = saved(*args, **kwargs)
        return o_loc, q_tilde, S_loc, torch.zeros_like(M)
    spd._widened_pass = forgetful if drop else saved
    try:
        yield
    finally:
        spd._widened_pass = saved


def _worker(rank, P):
    def run(variant, *ins):
        method, algo, varlen = variant
        sp = SPContext(method="zeco" if method == "zeco_no_M" else method, scan=AllScanArgs(algorithm=algo, n_blocks=3))
        with without_transition(method == "zeco_no_M"):
            return sp_gated_delta(*ins, sp=sp, cu_seqlens=docs_for(P) if varlen else None)
    out = rank_results(rank, T_LOCAL, VARIANTS, lambda variant: global_inputs(P, B=1 if variant[2] else B), run)
    out["pair_scan"] = _scan_worker(rank, P)
    return out


def single_device(P, varlen):
    *ins, do = global_inputs(P, B=1 if varlen else B)
    cu = docs_for(P) if varlen else None
    ref = fwd_bwd(lambda *x: sp_gated_delta(*x, cu_seqlens=cu), ins, do)  # no process group: the plain kernel
    oracle = fwd_bwd(lambda q, k, v, g, b: naive_gated_delta(q, k, v, (g, b), cu_seqlens=cu)[0],
                     [t.double() for t in ins], do.double())
    return ref, oracle


NAMES = "o dq dk dv dg dbeta".split()


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 4])
def test_sp_gated_delta_equals_single_device(P):
    per_rank = run_on_ranks(_worker, P, timeout_s=240)
    check_pair_scan([r["pair_scan"] for r in per_rank])
    refs = {vl: single_device(P, vl) for vl in (False, True)}
    for varlen, (ref, oracle) in refs.items():  # the single-device kernel itself is the oracle's
        expect_close(rel_errors(ref, oracle, NAMES), 2e-5, f"single device vs float64 oracle (varlen={varlen})")
    # broken on purpose: the same comparison must fail. Without M the combine is still right
    # at P = 2 (the first rank's S_in is 0, so S_in(1) = S_loc(0)); from P = 3 on it is not.
    expect_matches_reference(per_rank, VARIANTS, refs, NAMES, 2e-5, f"gated delta at P={P} vs single device",
                             broken=lambda variant: variant[0] == "local" or (variant[0] == "zeco_no_M" and P > 2),
                             caught=["o", "dk", "dbeta"])


def _p1_worker(rank, P):
    *ins, do = global_inputs(1)
    return fwd_bwd(lambda *x: sp_gated_delta(*x, sp=SPContext(method="none")), ins, do)


@pytest.mark.slow
def test_group_of_one_rank_is_the_kernel():
    got = run_on_ranks(_p1_worker, 1, timeout_s=60)[0]
    *ins, do = global_inputs(1)
    want = fwd_bwd(lambda q, k, v, g, b: chunk_gated_delta(q, k, v, (g, b))[0], ins, do)
    expect_equal(got, want, NAMES, "a group of one rank vs the kernel")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_gated_delta_matches_torch_on_gpu():
    """fla's chunk_gated_delta_rule vs the torch backend: layout, scale, initial/final state and the
    l2norm convention (fla's in-kernel l2norm vs ours applied before)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    gen = torch.Generator(device="cuda").manual_seed(0)
    Bg, T, Hg, Kg, Vg = 2, 300, 4, 64, 32
    q, k = (torch.randn(Bg, T, Hg, Kg, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(Bg, T, Hg, Vg, generator=gen, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(Bg, T, Hg, generator=gen, device="cuda") + 3)
    beta = torch.rand(Bg, T, Hg, generator=gen, device="cuda")
    q, k, v, g, beta = (t.requires_grad_() for t in (q, k, v, g, beta))
    h0 = torch.randn(Bg, Hg, Kg, Vg, device="cuda")
    do = torch.randn_like(v)
    res = {}
    for backend in ("fla", "torch"):
        if backend == "fla":
            o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
        else:
            o, ht = TORCH.chunk_gated_delta(l2norm(q.float()), l2norm(k.float()), v.float(), (g, beta.float()),
                                            scale=0.3, initial_state=h0, output_final_state=True)
        res[backend] = [o, ht]
    _close(res["fla"], res["torch"], "o ht".split())
    for backend in ("fla", "torch"):
        o, ht = res[backend]
        res[backend] += grads_or_skip(lambda o=o, ht=ht: torch.autograd.grad((o.float() * do.float()).sum() + ht.sum(),
                                                                            (q, k, v, g, beta)))
    _close(res["fla"], res["torch"], "o ht dq dk dv dg dbeta".split())


def _close(got, want, names, tol=2e-2):
    for name, a, b in zip(names, got, want):
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < tol, f"{name}: relative error {rel:.3e}"


# ----------------------------------------------------------------------------- the model variant

def test_model_variant_counts_and_trains():
    import dataclasses

    from apps.gla.model import GLAArgs, GLAForCausalLM, count_params
    args = GLAArgs(dim=32, n_layers=2, n_heads=2, ffn_hidden=64, vocab_size=61, attn_variant="gated_deltanet")
    m = GLAForCausalLM(args)
    m.init_weights(0)
    attn = m.model.layers[0].attn
    assert type(attn).__name__ == "GatedDeltaNet" and attn.a_proj.weight.shape == (2, 32)
    assert count_params(args)["total"] == sum(p.numel() for p in m.parameters())
    x = torch.randint(0, args.vocab_size, (2, 40))
    loss, n = m(x, labels=x)
    loss.backward()
    for name in ("A_log", "dt_bias", "a_proj.weight", "b_proj.weight", "k_proj.weight"):
        assert attn.get_parameter(name).grad.abs().sum() > 0, name
    assert count_params(dataclasses.replace(args, attn_variant="gla"))["total"] != count_params(args)["total"]


TRAIN = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
         "model.attn_variant=gated_deltanet", "data.batch_size=2", "logging.freq=1", "optim.warmup=2",
         "optim.lr=1e-2", "data.prefetch=0", "steps=4", "checkpoint.dump.every=100"]


def _train_on_rank(rank, world, argvs):
    from apps.gla.train import TrainArgs, train
    from lingua_zeco.args import parse_args
    torch.set_num_threads(1)
    return [train(parse_args(TrainArgs, argv))["losses"] for argv in argvs]  # one spawn, several runs


@pytest.mark.slow
def test_model_sp2_trains_as_sp1(tmp_path):
    """model.attn_variant=gated_deltanet: 4 steps on 2 x 64 tokens split over 2 ranks (zeco and
    local) vs 128 tokens on one: zeco's loss curve is the same, local's is not."""
    from apps.gla.train import TrainArgs, train
    from lingua_zeco.args import parse_args
    from lingua_zeco.metrics import read_metrics
    ref = train(parse_args(TrainArgs, [*TRAIN, f"dump_dir={tmp_path / 'sp1'}", "data.seq_len=128"]))["losses"]
    ref = torch.tensor([ref[s] for s in sorted(ref)])
    methods = ("zeco", "local")
    argvs = [[*TRAIN, f"dump_dir={tmp_path / m}", "data.seq_len=64", "distributed.sp_size=2",
              f"distributed.sp_method={m}"] for m in methods]
    got = run_on_ranks(_train_on_rank, 2, argvs, timeout_s=120)
    assert got[0] == got[1]  # every rank reports the global loss
    curves = {m: torch.tensor([c[s] for s in sorted(c)]) for m, c in zip(methods, got[0])}
    assert ref[-1] < ref[0]  # it learns
    torch.testing.assert_close(curves["zeco"], ref, rtol=2e-5, atol=0)
    assert ((curves["local"] - ref).abs() / ref).max() > 1e-4, (curves["local"], ref)  # observed 6e-4 vs 1e-7
    gn = [[r["grad_norm"] for r in read_metrics(tmp_path / d / "metrics.jsonl")] for d in ("sp1", "zeco")]
    torch.testing.assert_close(torch.tensor(gn[1]), torch.tensor(gn[0]), rtol=1e-4, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_widened_pass_two_virtual_ranks_on_gpu():
    """The zeco composition on fla's kernel, two virtual ranks on one GPU: the second half's widened
    pass ([v | 0] from [0 | I]) plus q̃ S_in, with S_in the first half's final state, equals
    single-device fla on the whole sequence (o and every gradient); dropping S_in is caught."""
    from lingua_zeco.sp.delta import _widened_pass
    from lingua_zeco.sp.varlen import LocalSegments
    gen = torch.Generator(device="cuda").manual_seed(1)
    Bg, T, Hg, Kg, Vg = 1, 512, 4, 64, 64
    q = torch.randn(Bg, T, Hg, Kg, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = l2norm(torch.randn(Bg, T, Hg, Kg, generator=gen, device="cuda", dtype=torch.bfloat16))
    v = torch.randn(Bg, T, Hg, Vg, generator=gen, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(Bg, T, Hg, generator=gen, device="cuda") + 6)  # slow decay: S_in matters
    beta = torch.rand(Bg, T, Hg, generator=gen, device="cuda")
    do = torch.randn_like(v)
    ins = [t.requires_grad_() for t in (q, k, v, g, beta)]
    fla = DeltaOptions(backend="fla")
    ref_o, _ = fla.chunk_gated_delta(*ins[:3], tuple(ins[3:]))
    results = {}
    for keep in (True, False):
        h = T // 2
        first, second = ([t[:, :h] for t in ins], [t[:, h:] for t in ins])
        o0, S0 = fla.chunk_gated_delta(*first[:3], tuple(first[3:]), output_final_state=True)
        o_loc, q_t, _, _ = _widened_pass(*second[:3], tuple(second[3:]), scale=Kg ** -0.5,
                                         seg=LocalSegments(None, h, 1), opts=fla)
        o1 = o_loc.float() + (torch.einsum("bthk,bhkv->bthv", q_t.float(), S0.float()) if keep else 0)
        results[keep] = torch.cat([o0.float(), o1], 1)
    _close([results[True]], [ref_o], ["o"])
    h = T // 2  # the second virtual rank's outputs, with and without S_in
    rel = (results[False][:, h:] - ref_o[:, h:].float()).norm() / ref_o[:, h:].float().norm()
    assert rel > 5e-2, f"dropping S_in went unnoticed ({rel:.2e})"
    ref = [ref_o, *grads_or_skip(lambda: torch.autograd.grad((ref_o.float() * do.float()).sum(), ins))]
    got = [results[True], *torch.autograd.grad((results[True] * do.float()).sum(), ins)]
    _close(got, ref, NAMES)


# ----------------------------------------------------------------------------- bf16 autocast

# Under the trainer's bf16 autocast, the scan's matrix products and the correction S_inᵀ q̃ ran in bf16
# (autocast casts matmul/bmm). fp32 inputs must still give fp32-level results: bf16 misses this by far.
AUTOCAST_VARIANTS = [("zeco", "chain", False), ("zeco", "tree", False), ("zeco", "chain", True),
                     ("lasp1", "chain", True), ("lasp2", "chain", False), ("lasp2", "chain", True)]
AUTOCAST_TOL = 2e-5


def test_sp_gated_delta_under_bf16_autocast_stays_fp32():
    P = 3
    inputs = {vl: global_inputs(P, B=1 if vl else B) for vl in (False, True)}
    per_rank = run_on_ranks(autocast_worker, P, sp_gated_delta, inputs, docs_for(P), AUTOCAST_VARIANTS, T_LOCAL,
                            timeout_s=180)
    oracles = {vl: single_device(P, vl)[1] for vl in (False, True)}
    expect_all_close(per_rank, AUTOCAST_VARIANTS, lambda variant: oracles[variant[2]], NAMES, AUTOCAST_TOL,
                     "gated delta under bf16 autocast vs the float64 oracle:", dtype=torch.float32)


# ----------------------------------------------------------------------------- empty documents

@pytest.mark.parametrize("P", [1, 2])
def test_zero_length_documents_change_nothing(P):
    inputs = global_inputs(P, B=1)
    docs = docs_with_empty(P, T_LOCAL, inside=7, after=5, before_end=3)
    methods = [(m, "chain") for m in ("zeco", "lasp1", "lasp2")]
    per_rank = on_ranks(empty_docs_worker, P, sp_gated_delta, inputs, docs, methods, T_LOCAL, timeout_s=180)
    q, k, v, g, beta, _ = inputs
    oracle = naive_gated_delta(q, k, v, (g, beta), cu_seqlens=docs)[0]
    expect_pairs_equal(per_rank, NAMES, oracle, 2e-5, f"at P={P} with and without empty documents")
