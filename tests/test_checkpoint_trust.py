"""Loading a checkpoint someone else wrote never runs code from it. Each loadable pickle of a checkpoint
folder gets a payload (an object whose unpickling creates a file), re-hashed into COMPLETE as an attacker
would; every loader refuses it with one line naming the file, and the payload's file never appears."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from apps.gla.model import GLAForCausalLM
from apps.gla.train import TrainArgs
from lingua_zeco.args import ConfigError, dump_config, parse_args
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


def _rewrite_metadata(folder: Path, change) -> None:
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own, written by the fixture
    change(meta)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def _shards_at(path: str):
    def change(meta):
        for info in meta.storage_data.values():
            info.relative_path = path
    return change


@pytest.mark.parametrize("case", ["absolute shard path", "../ shard path", "/dev/zero", "linked shard",
                                  "piped rank file", "persistent id", "tensor entry"])
def test_resume_reads_nothing_outside_the_folder_and_refuses_rather_than_falls_back(tmp_path, case):
    """What .metadata names is read from inside the folder only, and only from regular files; a folder whose
    files were changed that way (or whose pickles hold what no writer puts there) is refused, not taken for a
    damaged one: falling back to the step before would hide it, and a new save of that step would delete it."""
    mgr, folder, model, opt = _saved(tmp_path)
    older = Path(mgr.save(1, model, opt, extra={"step": 1}, per_rank={}))  # what a fallback would resume from
    outside = tmp_path / "outside.distcp"
    shutil.copy(folder / "__0_0.distcp", outside)
    marker = tmp_path / "ran"
    if case == "absolute shard path":
        _rewrite_metadata(folder, _shards_at(str(outside)))
    elif case == "../ shard path":
        _rewrite_metadata(folder, _shards_at("../../../outside.distcp"))
    elif case == "/dev/zero":
        _rewrite_metadata(folder, _shards_at("/dev/zero"))
    elif case == "linked shard":
        (folder / "__0_0.distcp").unlink()
        (folder / "__0_0.distcp").symlink_to(outside)
    elif case == "piped rank file":
        pass  # made after the re-hash, below
    elif case == "persistent id":  # a reference to state outside the pickle
        (folder / ".metadata").write_bytes(b"\x80\x04X\x01\x00\x00\x00aQ.")
    else:  # a tensor entry's bytes replaced by a pickle of the payload (DCP reads tensors weights-only)
        payload = io.BytesIO()
        torch.save({"x": Payload(marker)}, payload)
        offset = (folder / "__0_0.distcp").stat().st_size
        with open(folder / "__0_0.distcp", "ab") as f:
            f.write(payload.getvalue())

        def change(meta):
            index = next(i for i in meta.storage_data if i.fqn == "model.0.weight")
            meta.storage_data[index].offset, meta.storage_data[index].length = offset, len(payload.getvalue())
        _rewrite_metadata(folder, change)
    _rehash(folder)
    if case == "piped rank file":  # a reader would wait for a writer forever
        (folder / "rank0.pt").unlink()
        os.mkfifo(folder / "rank0.pt")
    with pytest.raises(UntrustedCheckpointError) as e:
        mgr.maybe_resume(*_model_and_opt())
    assert "\n" not in str(e.value) and str(folder) in str(e.value), e.value
    assert not marker.exists() and older.exists()
    with pytest.raises(ConfigError):  # the weights alone (eval, generate, export, init_ckpt_path) refuse it too
        mgr.load_model_only(str(folder), _model_and_opt()[0])
    assert not marker.exists()


@pytest.mark.parametrize("name", ["tokenizer", "weights", "metadata"])
def test_an_export_reads_no_link_out_of_its_folder(tmp_path, name):
    from apps.gla.export_hf import META, WEIGHTS, export, load_export

    folder = Path(export(GLAForCausalLM(TINY_1), str(tmp_path / "export"), dtype="fp32"))
    outside = tmp_path / "outside"
    outside.write_text("SECRET")
    file = {"tokenizer": "tokenizer.model", "weights": WEIGHTS, "metadata": META}[name]
    if name == "tokenizer":
        meta = json.loads((folder / META).read_text())
        meta["tokenizer"] = {"name": "sp", "file": file}
        (folder / META).write_text(json.dumps(meta))
    else:
        shutil.copy(folder / file, outside)  # a valid file: only where it lies is wrong
        (folder / file).unlink()
    (folder / file).symlink_to(outside)
    with pytest.raises(ConfigError, match="not a file of the export folder|is a link out of its folder") as e:
        load_export(str(folder))
    assert "SECRET" not in str(e.value)


def test_an_export_of_impossible_size_is_one_line(tmp_path):
    from apps.gla.export_hf import META, export

    folder = Path(export(GLAForCausalLM(TINY_1), str(tmp_path / "export"), dtype="fp32"))
    meta = json.loads((folder / META).read_text())
    meta["model"].update(dim=1 << 20, vocab_size=1 << 24, n_heads=1)  # 2^44 weights in the embedding alone
    (folder / META).write_text(json.dumps(meta))
    (code, err), = run_cases([("apps.gla.generate", [f"export={folder}", "max_tokens=1"])])
    assert_one_error_line(code, err, "describes a model that cannot be built here")


@pytest.mark.parametrize("line", ["base: /etc/hostname", "name: ${oc.env:HOME}"])
def test_a_run_folders_config_reads_no_other_file_nor_the_environment(tmp_path, line):
    run = tmp_path / "run"
    saved_run(run, TINY_1)
    config = run / "config.yaml"
    config.write_text(f"{line}\n" + "\n".join(l for l in config.read_text().splitlines() if not l.startswith("name:")))
    (code, err), = run_cases([("apps.gla.eval", [f"dump_dir={run}", "eval.steps=1"])])
    assert_one_error_line(code, err, f"{config}: its key {line.split(':')[0]} reads")
    assert os.environ["HOME"] not in err.replace(str(tmp_path), "")


def test_a_piped_marker_is_torn_not_waited_on(tmp_path):
    """A COMPLETE marker that is a pipe: the folder counts as torn at once (a reader would wait for a writer)."""
    mgr, folder, _, _ = _saved(tmp_path)
    (folder / MARKER).unlink()
    os.mkfifo(folder / MARKER)
    unblock = threading.Timer(5, lambda: (folder / MARKER).write_text("{}"))  # ends a wait, if there is one
    unblock.start()
    t0 = time.monotonic()
    try:
        assert mgr.complete_checkpoints() == [] and time.monotonic() - t0 < 4
    finally:
        unblock.cancel()
