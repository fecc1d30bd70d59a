"""Bad input to the inference programs (eval, generate, export_hf): one `error: ...` line naming the key
or the file, exit code 2, no traceback; export_hf never replaces what it did not write and loses nothing
when it fails halfway. All cases in one interpreter (test_entry_points.DRIVER): imports cost seconds."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from apps.gla import export_hf
from apps.gla.model import GLAArgs
from test_entry_points import assert_one_error_line, run_cases
from tiny_run import saved_run

TINY = GLAArgs(dim=32, n_layers=2, n_heads=2, ffn_hidden=64, vocab_size=258)
EVAL, GEN, EXPORT = "apps.gla.eval", "apps.gla.generate", "apps.gla.export_hf"


def _bad_cases(tmp: Path) -> dict[str, tuple[str, list[str], str]]:
    """name -> (module, argv, a substring the error line must hold: the key, the value or the file).
    tmp/run: a run with a checkpoint; tmp/<name>: the folders and files the fixture prepares."""
    run, gen = [f"dump_dir={tmp}/run", "eval.steps=1"], [f"dump_dir={tmp}/run", "max_tokens=4"]
    cases = {
        "eval-out-is-a-folder": (EVAL, [*run, f"out={tmp}"], "out="),
        "eval-context-negative": (EVAL, [*run, "context=-5"], "context=-5"),
        "eval-batch_size-negative": (EVAL, [*run, "eval.batch_size=-1"], "eval.batch_size=-1"),
        "eval-device-bogus": (EVAL, [*run, "device=bogus"], "device='bogus'"),
        "generate-top_p-0": (GEN, [*gen, "top_p=0"], "top_p=0"),
        "generate-top_p-negative": (GEN, [*gen, "top_p=-0.5"], "top_p=-0.5"),
        "generate-top_p-above-1": (GEN, [*gen, "top_p=1.5"], "top_p=1.5"),
        "generate-temperature-negative": (GEN, [*gen, "temperature=-1"], "temperature=-1"),
        "generate-temperature-inf": (GEN, [*gen, "temperature=inf"], "temperature=inf"),
        "generate-seed-past-64-bits": (GEN, [*gen, "seed=100000000000000000000000"], "seed="),
        "generate-max_tokens-negative": (GEN, [*gen, "max_tokens=-1"], "max_tokens=-1"),
        "generate-top_k-negative": (GEN, [*gen, "top_k=-3"], "top_k=-3"),
        "generate-device-bogus": (GEN, [*gen, "device=bogus"], "device='bogus'"),
        "generate-export-truncated-weights": (GEN, [f"export={tmp}/truncated"], "model.safetensors"),
        "generate-export-tiny-weights": (GEN, [f"export={tmp}/tiny"], "model.safetensors"),
        "generate-export-corrupt-meta": (GEN, [f"export={tmp}/corrupt_meta"], "lingua_zeco.json"),
        "generate-export-meta-without-model": (GEN, [f"export={tmp}/empty_meta"], "lingua_zeco.json"),
        "export_hf-out-is-a-file": (EXPORT, [f"dump_dir={tmp}/run", f"out={tmp}/a_file"], "out="),
        "export_hf-out-is-not-an-export": (EXPORT, [f"dump_dir={tmp}/run", f"out={tmp}/mine"], "out="),
    }
    if not torch.cuda.is_available():  # device=cuda is fine where there is one
        cases["eval-device-cuda-without-cuda"] = (EVAL, [*run, "device=cuda"], "CUDA is not available")
        cases["generate-device-cuda-without-cuda"] = (GEN, [*gen, "device=cuda"], "CUDA is not available")
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """(tmp, model, [exit code, stderr] of export_hf over an older export, {case: (code, stderr, expected)})."""
    tmp = tmp_path_factory.mktemp("bad_inference")
    model, _ = saved_run(tmp / "run")
    export_hf.export(model, str(tmp / "good"), dtype="fp32")
    for name in ("truncated", "tiny", "corrupt_meta", "empty_meta", "older"):
        shutil.copytree(tmp / "good", tmp / name)
    weights = tmp / "truncated" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # the header intact, the tensors cut
    os.truncate(tmp / "tiny" / "model.safetensors", 5)  # not even the header's length
    (tmp / "corrupt_meta" / "lingua_zeco.json").write_text('{"model": {"dim": 32,')
    (tmp / "empty_meta" / "lingua_zeco.json").write_text("{}")
    (tmp / "older" / "stale.txt").write_text("from an earlier export")
    (tmp / "a_file").write_text("keep me")
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("keep me")
    replace = (EXPORT, [f"dump_dir={tmp}/run", f"out={tmp}/older", "dtype=fp32"])
    cases = _bad_cases(tmp)
    got = run_cases([replace, *[c[:2] for c in cases.values()]])
    return tmp, model, got[0], {name: (*r, cases[name][2]) for name, r in zip(cases, got[1:])}


@pytest.mark.parametrize("case", sorted(_bad_cases(Path("/unused"))))
def test_bad_inference_input_is_one_error_line_and_exit_2(results, case):
    assert_one_error_line(*results[3][case])


def test_refused_outputs_are_untouched(results):
    tmp = results[0]
    assert (tmp / "a_file").read_text() == "keep me"
    assert sorted(os.listdir(tmp / "mine")) == ["notes.txt"] and (tmp / "mine" / "notes.txt").read_text() == "keep me"


def test_export_over_an_older_export_replaces_it_with_a_warning(results):
    tmp, _, (code, err), _ = results
    assert code == 0 and "Traceback" not in err, err[-2000:]
    warned = [line for line in err.splitlines() if str(tmp / "older") in line and "replac" in line]
    assert len(warned) == 1, err[-2000:]
    assert not (tmp / "older" / "stale.txt").exists()  # the whole folder is the new export
    model, tok = export_hf.load_export(str(tmp / "older"))
    assert tok.n_words == 258 and model.args.dim == TINY.dim


def test_a_failed_export_loses_nothing(results, monkeypatch):
    """Disk full while writing the weights: the older export stays whole, no half-written folder is left."""
    import safetensors.torch

    tmp, model = results[:2]
    keep = tmp / "keep"
    shutil.copytree(tmp / "good", keep)
    before = {p.name: p.read_bytes() for p in keep.iterdir()}

    def half_written(state, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    with pytest.raises(OSError, match="No space"):
        export_hf.export(model, str(keep), dtype="bf16")
    assert {p.name: p.read_bytes() for p in keep.iterdir()} == before
    assert not [n for n in os.listdir(tmp) if n.startswith(".keep")], os.listdir(tmp)
