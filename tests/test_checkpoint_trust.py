"""Loading a checkpoint someone else wrote never runs code from it. Each loadable pickle of a checkpoint
folder gets a payload (an object whose unpickling creates a file), re-hashed into COMPLETE as an attacker
would; every loader refuses it with one line naming the file, and the payload's file never appears."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from apps.gla.model import GLAForCausalLM
from apps.gla.train import TrainArgs
from lingua_zeco.args import dump_config, parse_args
from lingua_zeco.checkpoint import MARKER, CheckpointArgs, CheckpointManager, UntrustedCheckpointError, load_file
from lingua_zeco.checkpoint.integrity import checksums
from lingua_zeco.checkpoint.step_folder import dcp_state
from test_entry_points import assert_one_error_line, run_cases
from tiny_run import TINY, saved_run


class Payload:
    """Unpickled, it creates the file `marker` (what an attacker's code would do instead)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def _rehash(folder: Path) -> None:
    marker = json.loads((folder / MARKER).read_text())
    marker["files"] = {k: v for k, v in checksums(str(folder), 0, 1).items() if k != MARKER}
    (folder / MARKER).write_text(json.dumps(marker))


def _poison_pt(folder: Path, name: str, marker: Path) -> None:
    obj = load_file(str(folder / name))
    obj["payload"] = Payload(marker)
    torch.save(obj, folder / name)


def _poison_metadata(folder: Path, marker: Path) -> None:
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own, written by the fixture
    meta.planner_data["payload"] = Payload(marker)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def _poison_entry(folder: Path, marker: Path, model, opt) -> None:
    """The optimizer's learning rate (a non-tensor entry, which DCP pickles) replaced by the payload."""
    state = dcp_state(model, opt)
    state["optim"]["param_groups"][0]["lr"] = Payload(marker)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _saved(tmp_path: Path):
    model, opt = _model_and_opt()
    mgr = CheckpointManager(CheckpointArgs(), str(tmp_path / "run"))
    folder = Path(mgr.save(2, model, opt, extra={"step": 2}, per_rank={"rng": torch.get_rng_state()}))
    mgr.close()
    return mgr, folder, model, opt


def test_the_payload_runs_when_unpickled_in_full(tmp_path):
    """The control: the payload is live, so a loader that unpickled it would be caught."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


def test_an_untouched_checkpoint_resumes(tmp_path):
    mgr, folder, model, opt = _saved(tmp_path)
    fresh, fresh_opt = _model_and_opt()
    step, extra, per_rank = mgr.maybe_resume(fresh, fresh_opt)
    assert (step, extra) == (2, {"step": 2}) and torch.equal(per_rank["rng"], torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


@pytest.mark.parametrize("where", ["extra.pt", "rank0.pt", ".metadata", "optimizer entry"])
def test_resume_refuses_a_payload(tmp_path, where):
    mgr, folder, model, opt = _saved(tmp_path)
    marker = tmp_path / "ran"
    if where == ".metadata":
        _poison_metadata(folder, marker)
    elif where == "optimizer entry":
        _poison_entry(folder, marker, model, opt)
    else:
        _poison_pt(folder, where, marker)
    _rehash(folder)
    with pytest.raises(UntrustedCheckpointError) as e:
        mgr.maybe_resume(*_model_and_opt())
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and ("lr" in msg if where == "optimizer entry" else str(folder / where) in msg), msg


def test_init_weights_refuse_a_metadata_payload(tmp_path):
    mgr, folder, _, _ = _saved(tmp_path)
    marker = tmp_path / "ran"
    _poison_metadata(folder, marker)
    _rehash(folder)
    for path in (folder, folder.parent):  # a step folder, and a checkpoints root
        with pytest.raises(UntrustedCheckpointError, match=r"\.metadata holds builtins\.exec"):
            mgr.load_model_only(str(path), _model_and_opt()[0])
    assert not marker.exists()


TINY_1 = dataclasses.replace(TINY, n_layers=1)


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """A tiny run folder per poisoned file; eval, generate, export_hf, train (resume) and a fresh run's
    checkpoint.init_ckpt_path on each, in one interpreter. (tmp, {case: (code, stderr, expected)})."""
    tmp = tmp_path_factory.mktemp("trust")
    cases = {}
    for where in ("extra.pt", ".metadata"):
        run = tmp / where.strip(".").replace(".", "_")
        _, folder = saved_run(run, TINY_1)
        marker = tmp / f"ran_{run.name}"
        _poison_metadata(folder, marker) if where == ".metadata" else _poison_pt(folder, where, marker)
        _rehash(folder)
        named = str(folder / where)
        cases[f"eval-{where}"] = ("apps.gla.eval", [f"dump_dir={run}", "eval.steps=1"], named)
        cases[f"train-resume-{where}"] = ("apps.gla.train", [f"config={run}/config.yaml", "steps=6"], named)
        if where == ".metadata":  # the weights alone: extra.pt is not read
            cases["generate-.metadata"] = ("apps.gla.generate", [f"dump_dir={run}", "max_tokens=2"], named)
            cases["export-.metadata"] = ("apps.gla.export_hf", [f"dump_dir={run}", f"out={tmp}/export"], named)
            fresh = tmp / "fresh"
            dump_config(parse_args(TrainArgs, [f"config={run}/config.yaml", f"dump_dir={fresh}"]), fresh)
            cases["init_ckpt_path-.metadata"] = ("apps.gla.train", [
                f"config={fresh}/config.yaml", "steps=1", f"checkpoint.init_ckpt_path={folder}"], named)
    got = run_cases([c[:2] for c in cases.values()])
    shutil.rmtree(tmp / "export", ignore_errors=True)
    return tmp, {name: (*r, cases[name][2]) for name, r in zip(cases, got)}


CLI_CASES = ["eval-extra.pt", "train-resume-extra.pt", "eval-.metadata", "train-resume-.metadata",
             "generate-.metadata", "export-.metadata", "init_ckpt_path-.metadata"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_every_entry_point_refuses_a_payload_in_one_line(cli_results, case):
    tmp, results = cli_results
    assert_one_error_line(*results[case])
    assert not [p for p in os.listdir(tmp) if p.startswith("ran_")]


@pytest.mark.parametrize("name", ["../outside.model", "/etc/hostname", "sub/tokenizer.model", ".."])
def test_an_export_names_no_file_outside_its_folder(tmp_path, name):
    from apps.gla.export_hf import META, export, load_export
    from lingua_zeco.args import ConfigError

    model = GLAForCausalLM(TINY_1)
    folder = Path(export(model, str(tmp_path / "export"), dtype="fp32"))
    meta = json.loads((folder / META).read_text())
    assert load_export(str(folder))[0] is not None  # the untouched export loads
    meta["tokenizer"] = {"name": "sp", "file": name}
    (folder / META).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="not a file of the export folder"):
        load_export(str(folder))


def test_a_marker_naming_a_path_outside_its_folder_is_torn(tmp_path, caplog):
    mgr, folder, _, _ = _saved(tmp_path)
    (tmp_path / "outside").write_bytes(b"x")
    marker = json.loads((folder / MARKER).read_text())
    marker["files"]["../../../outside"] = {"size": 1, "sha256": "0" * 64}
    (folder / MARKER).write_text(json.dumps(marker))
    assert mgr.complete_checkpoints() == []
    assert "ignoring torn checkpoint" in caplog.text
