"""Retrieval evaluation (lingua_zeco/retrieval.py, apps/gla/retrieval_eval.py): the prompt's exact layout, the
segment-by-segment read with carried states against one whole forward (one device and SP = 2), the CLI
(eval on a run, generate on an export, task=loss at several lengths, bad input), and memory that does not
grow with the prompt. Random weights: the scores are not asserted, only that they are computed."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from apps.gla import export_hf
from apps.gla.model import GLAForCausalLM
from apps.gla.retrieval_eval import advance, check_model, prefill
from lingua_zeco.args import ConfigError
from lingua_zeco.comm import AllScanArgs
from lingua_zeco.retrieval import TEMPLATES, Cell, PromptBuilder, parse_depths, parse_lengths, score, table
from lingua_zeco.sp import SPContext
from lingua_zeco.tokenizer import ByteTokenizer
from local_ranks import run_on_ranks
from tiny_run import TINY, saved_run
from test_entry_points import ROOT, assert_one_error_line, run_cases

EVAL, GEN = "apps.gla.eval", "apps.gla.generate"


def _model(sp=None, **over):
    model = GLAForCausalLM(dataclasses.replace(TINY, fused_kernels=False, compile="none", init_std=0.1, **over), sp=sp)
    model.init_weights(3)
    return model.eval()


# -- prompts ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_prompt_layout(task):
    """Exactly `length` tokens: bos, intro, filler read cyclically from the trial's offset, the needle after
    round(depth x filler) filler tokens, the question last; the answer is the key the needle holds."""
    tok, t = ByteTokenizer(), TEMPLATES[task]
    filler = torch.arange(300, 300 + 97)  # ids no text has: where each filler token came from is visible
    build = PromptBuilder(task, tok, filler, digits=6, seed=1)
    head = [tok.bos_id, *tok.encode(t.intro, False, False)]
    question = tok.encode(t.question, False, False)
    for length in (400, 1000):
        key, offset, _ = build.trial(length, 2)
        needle = tok.encode(t.needle.format(key=key), False, False)
        n_fill = length - len(head) - len(needle) - len(question)
        for depth in (0.0, 0.3, 1.0):
            p = build.build(length, 2, depth)
            ids = p.ids.tolist()
            start = len(head) + round(depth * n_fill)
            assert len(ids) == length and p.needle == (start, start + len(needle))
            assert ids[:len(head)] == head and ids[-len(question):] == question
            assert ids[start:start + len(needle)] == needle
            fill = ids[len(head):start] + ids[start + len(needle):-len(question)]
            assert fill == [300 + (offset + i) % 97 for i in range(n_fill)]
            assert p.answer == tok.encode(" " + key, False, False) and len(key) == 6
    # a grid of depths shares each trial's key and filler; trials differ; drawn depths lie in [0, 1]
    assert build.build(1000, 0, 0.0).answer == build.build(1000, 0, 1.0).answer != build.build(1000, 1, 0.0).answer
    drawn = {build.build(400, i).depth for i in range(5)}
    assert len(drawn) == 5 and all(0 <= d <= 1 for d in drawn)
    with pytest.raises(ValueError, match="too short"):
        build.build(50, 0, 0.5)


def test_parse_lengths_and_depths():
    assert parse_lengths("2K, 1024,1M,3") == [3, 1024, 2048, 1 << 20]
    assert parse_depths("1,0,0.25") == [0.0, 0.25, 1.0]
    for bad in ("0", "-1", "1.5K", "abc", "", "1K,"):
        with pytest.raises(ValueError, match="lengths="):
            parse_lengths(bad)
    for bad in ("1.5", "-0.1", "nan", "x", "0,"):
        with pytest.raises(ValueError, match="depths="):
            parse_depths(bad)


def test_score_and_cells():
    """Teacher-forced scoring: a hit where the arg-max is the answer token; exact only when all are."""
    answer = [5, 7, 9]
    logits = torch.zeros(4, 12)  # one padding row past the answer
    logits[0, 5] = logits[1, 7] = logits[2, 1] = logits[3, 9] = 4.0
    hits, nll = score(logits, answer)
    assert hits.tolist() == [True, True, False]
    want = torch.nn.functional.cross_entropy(logits[:3], torch.tensor(answer), reduction="none")
    torch.testing.assert_close(nll, want)
    cell = Cell("needle", 1024, 0.5)
    cell.add(hits, nll)
    logits[2, 9] = 8.0
    cell.add(*score(logits, answer))
    rec = cell.record(segment=64)
    assert (rec["trials"], rec["accuracy"], rec["token_acc"], rec["segment"]) == (2, 0.5, 5 / 6, 64)
    assert "0.50" in table([cell]) and "1K" in table([cell])
    assert table([]).startswith("no results")


# -- the segmented read --------------------------------------------------------------------------------------
def _segmented_logits(model, ids, tail: int, segment: int):
    """Logits at the last `tail` positions: the rest read in segments, then the tail from the carried states."""
    states = prefill(model, ids[:, :-tail], segment)
    h, _ = advance(model, ids[:, -tail:], states)
    return model.lm_head(model.model.norm(h))


VARIANTS = {"gla": {}, "simple_gla": dict(attn_variant="simple_gla"),
            "gated_deltanet": dict(attn_variant="gated_deltanet"),
            "hybrid_window": dict(softmax_layers=[1], softmax_window=24)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_segments_equal_one_forward(variant):
    """fp32: 3 segments of 64 and one of 10 (then a tail of 6) give the whole forward's last logits."""
    torch.manual_seed(0)
    model = _model(**VARIANTS[variant])
    check_model(model)  # a windowed hybrid is accepted
    ids = torch.randint(0, 256, (2, 208))
    with torch.no_grad():
        want = model(ids)[:, -6:]
        got = _segmented_logits(model, ids, 6, 64)
        lost = advance(model, ids[:, -6:], [None] * 2)[0]  # no carried state: a test that can fail
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(model.lm_head(model.model.norm(lost)), want, rtol=1e-2, atol=1e-3)


def test_full_softmax_hybrid_refused():
    with pytest.raises(ConfigError, match="softmax_window"):
        check_model(_model(softmax_layers=[1]))


def _sp_worker(rank, P, segment):
    import torch.distributed as dist
    torch.set_num_threads(1)
    model = _model(SPContext(group=dist.group.WORLD, method="zeco", scan=AllScanArgs(algorithm="chain")))
    ids = torch.randint(0, 256, (1, 110), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return _segmented_logits(model, ids, 7, segment)  # 103 tokens: 3 segments of 16 x 2 ranks, 5, 1 local


def test_sp2_segments_equal_one_forward():
    model = _model()
    ids = torch.randint(0, 256, (1, 110), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids)[:, -7:]
    for got in run_on_ranks(_sp_worker, 2, 16):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# -- the commands --------------------------------------------------------------------------------------------
def _cases(tmp):
    run = [f"dump_dir={tmp}/run", "device=cpu"]
    good = {
        "passkey": (EVAL, [*run, "task=passkey", "lengths=512,1K", "trials=2", f"out={tmp}/pk.jsonl"]),
        "needle": (EVAL, [*run, "task=needle", "lengths=512,1K", "depths=0,0.5,1", "trials=2", "segment=128"]),
        "export": (GEN, [f"export={tmp}/exp", "task=needle", "lengths=600", "depths=0,1", "trials=1",
                         f"out={tmp}/exp.jsonl"]),
        "loss": (EVAL, [*run, "lengths=64,128", "eval.steps=1"]),
    }
    pk = [*run, "task=passkey"]
    bad = {
        "task": (EVAL, [*run, "task=bogus"], "task='bogus'"),
        "no-lengths": (EVAL, pk, "lengths="),
        "lengths-zero": (EVAL, [*pk, "lengths=0"], "'0'"),
        "lengths-text": (EVAL, [*pk, "lengths=1K,abc"], "'abc'"),
        "depths": (EVAL, [*pk, "lengths=1K", "depths=0,1.5"], "'1.5'"),
        "trials": (EVAL, [*pk, "lengths=1K", "trials=0"], "trials=0"),
        "too-short": (EVAL, [*pk, "lengths=16"], "too short"),
        "loss-lengths": (EVAL, [*run, "lengths=-4"], "'-4'"),
        "generate-run": (GEN, [f"dump_dir={tmp}/run", "task=passkey", "lengths=1K"], "apps.gla.eval"),
        "generate-loss": (GEN, [f"export={tmp}/exp", "task=loss", "lengths=1K"], "choose from passkey, needle"),
    }
    return good, bad


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retrieval")
    model, _ = saved_run(tmp / "run")
    export_hf.export(model, str(tmp / "exp"), dtype="fp32")
    good, bad = _cases(tmp)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # tiny ops: threads only contend on a loaded machine
        got = run_cases([*good.values(), *(c[:2] for c in bad.values())], stdout=True)
    return tmp, dict(zip(good, got)), {name: (*r[:2], bad[name][2]) for name, r in zip(bad, got[len(good):])}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name,path,cells", [("passkey", "pk.jsonl", 2), ("needle", "run/eval_needle.jsonl", 6),
                                             ("export", "exp.jsonl", 2)])
def test_cli_writes_table_jsonl_and_heat_map(cli, name, path, cells):
    tmp, good, _ = cli
    code, err, out = good[name]
    assert code == 0, err[-3000:]
    task = "passkey" if name == "passkey" else "needle"
    assert f"{task} accuracy" in out and "depth" in out, out
    rows = _lines(tmp / path)
    assert len(rows) == cells and {r["task"] for r in rows} == {task}
    assert all(r["trials"] == (1 if name == "export" else 2) and 0 <= r["accuracy"] <= 1 for r in rows)
    for r in rows:  # this rank's speed over its prompts; no device memory on a CPU
        assert r["seconds"] > 0 and r["tokens_per_s"] == pytest.approx(r["trials"] * r["length"] / r["seconds"])
        assert r["peak_gib"] is None
    if name == "needle":
        assert {(r["length"], r["depth"]) for r in rows} == {(n, d) for n in (512, 1024) for d in (0, 0.5, 1)}
        assert {r["segment"] for r in rows} == {128}
    if name == "passkey":
        assert {r["depth"] for r in rows} == {None} and {r["segment"] for r in rows} == {32}  # the run's seq_len
    png = (tmp / path).with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_loss_at_lengths(cli):
    code, err, out = cli[1]["loss"]
    assert code == 0, err[-3000:]
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["val_context"] for r in results] == [64, 128] and all(r["val_loss"] > 0 for r in results)


@pytest.mark.parametrize("case", sorted(_cases("/unused")[1]))
def test_bad_input_is_one_error_line(cli, case):
    assert_one_error_line(*cli[2][case])


def _sp_cli(rank, world, dump_dir, sp):
    """The eval command on 2 ranks: SP = 2 (a prompt that leaves a remainder after the group's pieces), or
    DP = 2 (the trials shared)."""
    from apps.gla import eval as gla_eval
    torch.set_num_threads(1)
    return gla_eval.run(gla_eval.EvalCLIArgs(dump_dir=dump_dir, task="needle", lengths="302", depths="0,1", trials=3,
                                             segment=16, sp_size=sp, device="cpu", out=f"{dump_dir}/sp{sp}.jsonl"))


def test_cli_sp2_and_dp2_equal_one_process(cli):
    """Every trial counted once, and the answers' likelihoods those of one process reading the whole prompt."""
    from apps.gla import eval as gla_eval
    run = str(cli[0] / "run")
    want = gla_eval.run(gla_eval.EvalCLIArgs(dump_dir=run, task="needle", lengths="302", depths="0,1", trials=3,
                                             segment=302, device="cpu", out=f"{run}/one.jsonl"))
    for sp in (2, 1):
        got = run_on_ranks(_sp_cli, 2, run, sp, timeout_s=180)
        for r in got:
            assert [(c["depth"], c["trials"], c["sp_size"]) for c in r] == [(0.0, 3, sp), (1.0, 3, sp)]
            for c, w in zip(r, want):
                assert c["answer_nll"] == pytest.approx(w["answer_nll"], rel=1e-5), (sp, c, w)
        assert len(_lines(cli[0] / "run" / f"sp{sp}.jsonl")) == 2  # rank 0 wrote


# -- memory --------------------------------------------------------------------------------------------------
MEMORY = r"""
import json, resource, sys, time
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
torch.set_num_threads(1)
from apps.gla.model import GLAArgs, GLAForCausalLM
from apps.gla.retrieval_eval import answer_hits, builtin_filler
from lingua_zeco.retrieval import PromptBuilder
from lingua_zeco.tokenizer import ByteTokenizer

class Largest(TorchDispatchMode):  # the largest tensor any op makes
    most = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.most = max([self.most, *sizes])
        return out

model = GLAForCausalLM(GLAArgs(dim=32, n_layers=2, n_heads=2, ffn_hidden=64, vocab_size=258))
model.init_weights(0)
tok = ByteTokenizer()
build = PromptBuilder("passkey", tok, builtin_filler(tok, 1 << 20))
out = {}
for length, segment in json.loads(sys.argv[1]):
    prompt = build.build(length, 0, 0.5)
    t0 = time.perf_counter()
    with Largest() as m:
        answer_hits(model, [prompt], segment, torch.device("cpu"))
    out[f"{length}/{segment}"] = dict(rss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, largest=m.most,
                                      seconds=time.perf_counter() - t0)
print(json.dumps(out))
"""
LONG = 128 * 1024


def test_memory_does_not_grow_with_the_prompt():
    """Segments of 2K: the largest tensor at 128K tokens is that at 2K and the process's peak (maxrss, after
    2K then 128K) stays within 1.5x; one forward over 16K tokens shows that the measure sees growth."""
    runs = [(2048, 2048), (LONG, 2048), (16384, 16384)]
    res = subprocess.run([sys.executable, "-c", MEMORY, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    short, long, whole = got["2048/2048"], got[f"{LONG}/2048"], got["16384/16384"]
    print(json.dumps(got))
    assert long["largest"] <= 1.5 * short["largest"], got
    assert long["rss_kb"] <= 1.5 * short["rss_kb"], got
    assert whole["largest"] > 4 * short["largest"], got
