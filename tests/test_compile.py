"""model.compile=blocks and model.float8 on CPU: a block traces into one graph with the GLA operator as
the custom op lingua_zeco::gla_fwd (no graph break), the op's schema, fake shapes and gradients are
right, the compiled model trains as the eager one (one rank under FSDP2, and SP = 2 where the exchange
runs outside the graph), and torchao's float8 (emulated) converts the block linears."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from apps.gla.compile import apply_speedups, compile_blocks
from apps.gla.layers import GLAArgs
from apps.gla.model import GLABlock, GLAForCausalLM
from apps.gla.train import TrainArgs, train
from lingua_zeco.args import parse_args
from lingua_zeco.kernels import chunk_gla_op, naive_gla
from lingua_zeco.kernels.gla_op import gla_fwd
from local_ranks import run_on_ranks

SMALL = dict(dim=64, n_layers=2, n_heads=2, ffn_hidden=128, vocab_size=97)


def _model(**kw) -> GLAForCausalLM:
    m = GLAForCausalLM(GLAArgs(**{**SMALL, "dtype": "fp64", **kw}))
    m.init_weights(0)
    return m


def _gla_inputs(T=40, H=2, K=8, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)) / 4
    return q, k, v, g


def test_block_is_one_graph_around_the_gla_custom_op():
    block = _model().blocks[0]
    x = torch.randn(1, 40, SMALL["dim"], dtype=torch.float64)
    ex = dynamo.explain(GLABlock.run)(block, x, None)
    assert ex.graph_break_count == 0, [b.reason for b in ex.break_reasons]
    assert ex.graph_count == 1
    assert "lingua_zeco.gla_fwd" in ex.graphs[0].code  # the operator is one opaque node


def test_packed_documents_leave_the_graph_once():
    """Packed documents: the attention runs outside the graph (the documented break; dynamo counts it once
    in every frame of the call stack it resumes), nothing else breaks."""
    from lingua_zeco.sp.varlen import as_packing
    block = _model().blocks[0]
    x = torch.randn(1, 40, SMALL["dim"], dtype=torch.float64)
    packing = as_packing([0, 13, 40], rank=0, P=1, T_local=40, device=x.device)
    ex = dynamo.explain(GLABlock.run)(block, x, packing)
    assert ex.graph_break_count >= 1
    assert all("_sp_gla" in b.reason for b in ex.break_reasons), [b.reason for b in ex.break_reasons]


def test_gla_op_schema_fake_and_autograd():
    q, k, v, g = _gla_inputs()
    torch.library.opcheck(gla_fwd, (q, k, v, g, 8 ** -0.5, False))
    torch.library.opcheck(gla_fwd, (q, k, v, g, 8 ** -0.5, True))


def test_gla_op_matches_float64_oracle_and_catches_a_dropped_gradient():
    q, k, v, g = (t.requires_grad_() for t in _gla_inputs())
    do = torch.randn(1, 40, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    got = torch.compile(chunk_gla_op, backend="aot_eager", fullgraph=True)(q, k, v, g)
    got_grads = torch.autograd.grad((got * do).sum(), (q, k, v, g))
    want = naive_gla(q, k, v, g)[0]
    want_grads = torch.autograd.grad((want * do).sum(), (q, k, v, g))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    # sensitivity: the gate's gradient carries the decay; a wrong one would miss by far more than 1e-9
    assert (got_grads[3] - torch.zeros_like(got_grads[3])).abs().max() > 1e-3


def _assert_compiled_equals_eager(T: int, seed: int, **kw) -> None:
    """The fp64 model with model kwargs `kw`, eager and with compiled blocks (aot_eager): the same loss and
    gradients to rounding."""
    x = torch.randint(0, SMALL["vocab_size"], (1, T), generator=torch.Generator().manual_seed(seed))
    results = []
    for compiled in (False, True):
        m = _model(**kw)
        if compiled:
            compile_blocks(m.blocks, backend="aot_eager")
        loss, _ = m(x, labels=x)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-12, atol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_compiled_model_equals_eager_fp64(ac):
    _assert_compiled_equals_eager(48, 1, activation_checkpointing=ac)


@pytest.mark.parametrize("kw", [dict(attn_variant="simple_gla"), dict(attn_variant="gated_deltanet"),
                                dict(softmax_layers=[1])], ids=["simple_gla", "gated_deltanet", "hybrid"])
def test_other_attention_variants_compile_around_their_sp_call(kw):
    """The other variants and softmax blocks run their SP entry outside the graph: same loss and gradients."""
    _assert_compiled_equals_eager(32, 3, **kw)


TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
        "data.batch_size=2", "logging.freq=1", "optim.warmup=2", "optim.lr=1e-2", "data.prefetch=0", "steps=3",
        "checkpoint.dump.every=100", "model.compile_backend=aot_eager"]


def _losses(rank, world, argv):
    torch.set_num_threads(1)
    out = train(parse_args(TrainArgs, argv))["losses"]
    return [out[s] for s in sorted(out)]


@pytest.mark.slow
def test_trainer_compiled_equals_eager_fsdp_and_sp2(tmp_path):
    """The trainer's loss curve with compiled blocks (one rank, the plain module; SP = 2 with ZeCO and FSDP2,
    the exchange outside the graph, and full activation checkpointing) equals the eager one."""
    from torch._dynamo.utils import counters
    ref = _losses(0, 1, [*TINY, f"dump_dir={tmp_path / 'eager'}", "data.seq_len=64", "model.compile=none"])
    counters.clear()
    one = _losses(0, 1, [*TINY, f"dump_dir={tmp_path / 'c1'}", "data.seq_len=64", "model.compile=blocks"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # both blocks share one graph: compiled once
    torch.testing.assert_close(torch.tensor(one), torch.tensor(ref), rtol=1e-6, atol=0)
    argv = [*TINY, f"dump_dir={tmp_path / 'c2'}", "data.seq_len=32", "distributed.sp_size=2",
            "distributed.sp_method=zeco", "model.compile=blocks", "model.activation_checkpointing=full"]
    two = run_on_ranks(_losses, 2, argv)[0]
    torch.testing.assert_close(torch.tensor(two), torch.tensor(ref), rtol=2e-5, atol=0)


def test_float8_converts_block_linears_and_stays_close():
    """torchao's float8 recipes (emulated on CPU): the block linears become Float8Linear, the rank-16 gate
    projections and the head stay; the loss moves by float8's rounding only (and does move: converted)."""
    from torchao.float8.float8_linear import Float8Linear
    x = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))
    base = GLAForCausalLM(GLAArgs(**{**SMALL, "dim": 128, "ffn_hidden": 256}))
    base.init_weights(0)
    ref = base(x, labels=x)[0].item()
    for recipe in ("tensorwise", "rowwise"):
        args = GLAArgs(**{**SMALL, "dim": 128, "ffn_hidden": 256, "float8": recipe, "compile": "none"})
        m = GLAForCausalLM(args)
        m.init_weights(0)
        names = apply_speedups(m, args, torch.device("cpu"))["float8"]
        kinds = {n: type(mod).__name__ for n, mod in m.named_modules()}
        assert len(names) == 2 * 8 and all(kinds[n] == "Float8Linear" for n in names)
        assert kinds["model.layers.0.attn.gk_proj.0"] == "Linear" and kinds["lm_head"] == "Linear"
        assert isinstance(m.model.layers[1].mlp.down_proj, Float8Linear)
        got = m(x, labels=x)[0].item()
        assert got != ref and abs(got / ref - 1) < 0.02, (recipe, got, ref)


def test_float8_head_and_bad_keys():
    args = GLAArgs(**{**SMALL, "dim": 128, "ffn_hidden": 256, "float8": "tensorwise", "float8_head": True})
    m = GLAForCausalLM(args)
    assert "lm_head" in apply_speedups(m, args, torch.device("cpu"))["float8"]
    for bad, msg in ((dict(float8="fp8"), "model.float8"), (dict(compile="yes"), "model.compile"),
                     (dict(float8_head=True), "float8_head")):
        with pytest.raises(ValueError, match=msg):
            GLAForCausalLM(GLAArgs(**{**SMALL, **bad}))


def _float8_run(argv, rule=None):
    """(losses by step, the model's float8 weights' local tensors) of a Trainer run; rule: the all-gather
    decision in place of the CUDA one."""
    import apps.gla.compile as compile_module
    from apps.gla.train import Trainer, with_vocab_size
    from lingua_zeco import distributed

    with pytest.MonkeyPatch.context() as mp:
        if rule is not None:
            mp.setattr(compile_module, "float8_all_gather", rule)
        args = with_vocab_size(parse_args(TrainArgs, argv))
        env = distributed.setup(args.distributed, args.model.gla_options())
        try:
            trainer = Trainer(args, env)
            losses = trainer.train()["losses"]
            weights = [m.weight._local_tensor for m in trainer.model.modules() if type(m).__name__ == "Float8Linear"]
            trainer.ckpt.close()
        finally:
            distributed.teardown(env)
    return losses, weights


def test_float8_all_gather_trains_and_resumes_as_the_full_precision_gather(tmp_path):
    """FSDP gathering the float8 linears' weights already cast, their scales precomputed after each step:
    forced here on one gloo rank (FSDP then gathers nothing between ranks; torchao emulates float8). Through
    meta init, async checkpoints and a resume, the losses are those of FSDP gathering the fp32 weights."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    def rule(args, fsdp, device):  # forced: wherever FSDP wraps tensorwise float8 linears
        return args.float8 == "tensorwise" and fsdp

    argv = [*TINY, "model.dim=64", "model.ffn_hidden=128", "model.float8=tensorwise", "model.compile=none",
            "distributed.fsdp=true", "data.seq_len=32", "steps=4", "checkpoint.dump.every=2",
            "checkpoint.async_save=true"]
    ref, plain = _float8_run([*argv, f"dump_dir={tmp_path / 'ref'}"])
    assert plain and not any(isinstance(w, WeightWithDynamicFloat8CastTensor) for w in plain)
    got, cast = _float8_run([*argv, f"dump_dir={tmp_path / 'ag'}"], rule)
    assert len(cast) == len(plain) and all(isinstance(w, WeightWithDynamicFloat8CastTensor) for w in cast)
    assert all(w._precomputed_scale is not None for w in cast)  # set by the step, not left to each gather
    assert sorted(got) == [1, 2, 3, 4] and got == ref
    _float8_run([*argv, f"dump_dir={tmp_path / 'resumed'}", "steps=2"], rule)
    resumed, _ = _float8_run([*argv, f"dump_dir={tmp_path / 'resumed'}"], rule)
    assert resumed == {s: ref[s] for s in (3, 4)}


def test_compile_mode_reaches_torch_compile(monkeypatch):
    """model.compile_mode goes to torch.compile with inductor (reduce-overhead: the CUDA-graph replay measured
    by bench_train's ours_cudagraphs); other backends take no mode."""
    import apps.gla.compile as compile_module
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    compile_module._compiled_run.cache_clear()
    try:
        blocks = _model().blocks
        compile_blocks(blocks, "inductor", "reduce-overhead")
        compile_blocks(blocks, "aot_eager", "reduce-overhead")
        compile_blocks(blocks, "inductor")
    finally:
        compile_module._compiled_run.cache_clear()
    assert seen == [dict(backend="inductor", dynamic=False, mode="reduce-overhead"),
                    dict(backend="aot_eager", dynamic=False), dict(backend="inductor", dynamic=False)]
    with pytest.raises(ValueError, match="compile_mode='fast'"):
        GLAArgs(compile_mode="fast").check()
