"""What happens when things go wrong (lingua_zeco/reliability/): exact resume after kill -9, stop
signals, non-finite steps, bad input, a dead or hanging peer, metrics that survive a crash."""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import apps.gla.train as trainer
import apps.gla.train_step as train_step
from apps.gla.train import TrainArgs, train
from lingua_zeco.args import parse_args
from lingua_zeco.checkpoint import MARKER
from lingua_zeco.metrics import LoggingArgs, MetricLogger, read_metrics
from lingua_zeco.reliability import NonFiniteError
from local_ranks import free_port, run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
        "data.batch_size=1", "data.seq_len=32", "logging.freq=1", "optim.warmup=2", "optim.lr=1e-2",
        "data.prefetch=0"]


def _argv(dump_dir, *extra) -> list[str]:
    return [*TINY, f"dump_dir={dump_dir}", *extra]


def _popen(dump_dir, *extra, env=None) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k != "LINGUA_ZECO_FAULT"}
    env = {**base, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "apps.gla.train", *_argv(dump_dir, *extra)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout=180) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def _ckpt(dump_dir, step) -> Path:
    return Path(dump_dir) / "checkpoints" / f"step_{step:010d}"


def _state(folder: Path, tmp: Path) -> dict:
    """Model + optimizer of a DCP checkpoint as one plain dict (every tensor)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{folder.parent.parent.name}_{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=False)


def _tensors(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _tensors(v, f"{prefix}{k}.")
    elif isinstance(d, torch.Tensor):
        yield prefix[:-1], d


def _same(a: dict, b: dict) -> list[str]:
    ta, tb = dict(_tensors(a)), dict(_tensors(b))
    assert ta.keys() == tb.keys() and ta
    return [k for k in ta if not torch.equal(ta[k], tb[k])]


def _losses(dump_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(Path(dump_dir) / "metrics.jsonl")]


# -- exact resume after kill -9 ----------------------------------------------------------------------
def test_kill9_after_checkpoint_resumes_bitwise(tmp_path):
    """20 steps in one go vs killed (SIGKILL) after step 12 with a checkpoint at 10, then the same command
    again: steps 11-20 have the same losses bit for bit, and the final model and optimizer are equal."""
    common = ["steps=20", "checkpoint.dump.every=10", "checkpoint.dump.keep=0"]
    ref = _popen(tmp_path / "ref", *common)
    cut = _popen(tmp_path / "cut", *common, env={"LINGUA_ZECO_FAULT": "SIGKILL@12"})
    rc, out, err = _finish(cut)
    assert rc == -signal.SIGKILL, err[-2000:]
    assert (_ckpt(tmp_path / "cut", 10) / MARKER).is_file() and not _ckpt(tmp_path / "cut", 20).exists()
    rc, out, err = _finish(_popen(tmp_path / "cut", *common))
    assert rc == 0 and "start at step 10" in out, err[-2000:]
    rc, _, err = _finish(ref)
    assert rc == 0, err[-2000:]
    full, cut_rows = dict(_losses(tmp_path / "ref")), _losses(tmp_path / "cut")
    # each step once: the killed run's lines 11-12 are removed by the rerun, which logs those steps again
    assert [s for s, _ in cut_rows] == list(range(1, 21))
    assert cut_rows[10:] == [(s, full[s]) for s in range(11, 21)]  # exact float equality
    assert _same(_state(_ckpt(tmp_path / "ref", 20), tmp_path), _state(_ckpt(tmp_path / "cut", 20), tmp_path)) == []
    # and the same data position (and RNG states) saved for the next resume
    ref_pr, cut_pr = (torch.load(_ckpt(tmp_path / d, 20) / "rank0.pt", weights_only=False) for d in ("ref", "cut"))
    assert _same(ref_pr, cut_pr) == [] and ref_pr["data"]["sources"] == cut_pr["data"]["sources"]


# -- stop signals ----------------------------------------------------------------------------------------
def test_sigusr2_saves_checkpoint_and_exits_zero(tmp_path):
    p = _popen(tmp_path, "steps=1000", "checkpoint.dump.every=1000", env={"LINGUA_ZECO_FAULT": "SIGUSR2@3"})
    rc, out, err = _finish(p)
    assert rc == 0, err[-2000:]
    # the signal came after step 3: step 4 is the boundary where it is seen, saved, and the run leaves
    assert (_ckpt(tmp_path, 4) / MARKER).is_file() and "stop signal (SIGUSR2" in out
    assert [s for s, _ in _losses(tmp_path)] == [1, 2, 3, 4]


def _signal_on_rank1(rank, world, argv):
    torch.set_num_threads(1)
    if rank == 1:
        os.environ["LINGUA_ZECO_FAULT"] = "SIGTERM@2"
    return train(parse_args(TrainArgs, argv))["step"]


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Only rank 1 gets SIGTERM; both ranks must stop after the same step and save together (a rank
    that left alone would leave the other blocked in a collective: run_on_ranks would time out)."""
    argv = _argv(tmp_path, "steps=1000", "checkpoint.dump.every=1000", "distributed.sp_size=2")
    assert run_on_ranks(_signal_on_rank1, 2, argv, timeout_s=120) == [3, 3]
    assert (_ckpt(tmp_path, 3) / MARKER).is_file()


# -- non-finite steps --------------------------------------------------------------------------------------
def _poisoning(monkeypatch, at: dict[int, str]):
    """forward_backward that makes the gradients (or the loss) of the given steps NaN, and records the
    model's weights when each step starts."""
    real, seen = train_step.forward_backward, []

    def fb(model, data, env, args, autocast):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        loss_sum, n_sum, wait = real(model, data, env, args, autocast)
        kind = at.get(len(seen))
        if kind == "grad":
            g = next(p for p in model.parameters() if p.grad is not None).grad
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
        elif kind == "loss":
            loss_sum = loss_sum * float("inf")
        return loss_sum, n_sum, wait

    monkeypatch.setattr(train_step, "forward_backward", fb)
    return seen


def _plain(sd):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}


def _skip_until_error(tmp_path, monkeypatch, at: dict[int, str], match: str, *extra) -> list[dict]:
    """Six steps poisoned at `at` under nonfinite=skip, max_skips=1: the NonFiniteError must match `match`.
    Returns the weights each step that ran started from."""
    seen = _poisoning(monkeypatch, at)
    argv = _argv(tmp_path, "steps=6", *extra, "reliability.nonfinite=skip", "reliability.max_skips=1")
    with pytest.raises(NonFiniteError, match=match):
        train(parse_args(TrainArgs, argv))
    return [_plain(s) for s in seen]


def _same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def test_nonfinite_skip_leaves_weights_and_optimizer_then_stops_after_max_skips(tmp_path, monkeypatch):
    match = r"step 4: .*loss inf.*2 steps skipped.*max_skips=1"
    w = _skip_until_error(tmp_path, monkeypatch, {2: "grad", 4: "loss"}, match, "checkpoint.dump.every=1",
                          "checkpoint.dump.keep=0")
    assert _same_weights(w[2], w[1])  # step 2 skipped: weights after it = before it
    assert not _same_weights(w[1], w[0])  # (step 1 did move them)
    s1, s2 = _state(_ckpt(tmp_path, 1), tmp_path), _state(_ckpt(tmp_path, 2), tmp_path)
    assert _same(s1["model"], s2["model"]) == [] and _same(s1["optim"]["state"], s2["optim"]["state"]) == []
    rows = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert rows[2]["skipped_steps"] == 1 and rows[3]["skipped_steps"] == 1 and rows[2]["grad_norm"] is None
    assert sorted(rows) == [1, 2, 3] and not _ckpt(tmp_path, 4).exists()  # nothing saved from the bad step
    # (a NaN grad norm is written as JSON null)


def test_nonfinite_stop_policy_exits_1_naming_the_step(tmp_path, monkeypatch, capsys):
    _poisoning(monkeypatch, {3: "grad"})
    with pytest.raises(SystemExit) as e:
        trainer.main(_argv(tmp_path, "steps=6", "checkpoint.dump.every=2", "reliability.nonfinite=stop"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "step 3: non-finite" in err[0] and "grad norm nan" in err[0], err
    assert (_ckpt(tmp_path, 2) / MARKER).is_file() and [s for s, _ in _losses(tmp_path)] == [1, 2]


def test_deferred_verdict_skips_on_device_and_stops_one_step_later(tmp_path, monkeypatch):
    """With no log/save between them, steps do not sync: a bad step's update is dropped by the fused
    AdamW on the device, and the host learns it (and applies the policy) at the next step."""
    w = _skip_until_error(tmp_path, monkeypatch, {2: "grad", 4: "grad"}, r"step 4: .*grad norm nan.*2 steps skipped",
                          "logging.freq=100", "checkpoint.dump.every=0")
    assert len(w) == 5  # raised while checking step 5, about step 4: one step late
    assert _same_weights(w[2], w[1]) and _same_weights(w[4], w[3])  # steps 2 and 4 dropped on the device
    assert not _same_weights(w[3], w[2])  # step 3 did move the weights


# -- bad input: one clear line, exit 2, nothing lost ---------------------------------------------------------
@pytest.mark.parametrize("extra, needle", [
    (["model.dimm=3"], "unknown config key 'model.dimm'"),
    (["distributed.sp_size=2"], "sp_size=2 does not divide the world size 1"),
    (["data.seq_len=0"], "data.seq_len=0 must be >= 1"),
    (["data.root_dir=/nonexistent/data"], "data.root_dir='/nonexistent/data' is not a folder"),
    (["data.tokenizer.name=sp", "data.tokenizer.path=/nonexistent/tok.model"], "/nonexistent/tok.model"),
    (["reliability.nonfinite=maybe"], "reliability.nonfinite='maybe'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, needle):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')  # an earlier run's history
    with pytest.raises(SystemExit) as e:
        trainer.main(_argv(tmp_path, "steps=2", *extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 5.0}]


def _docs_with_bad_line(folder: Path, bad_at: int) -> str:
    folder.mkdir(parents=True)
    lines = [json.dumps({"text": f"doc {i:03d} " * 2}) for i in range(40)]  # 18 tokens each
    lines[bad_at - 1] = '{"text": "cut short'
    (folder / "f.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder)


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_corrupt_jsonl_line_skip_counts_or_error_stops(tmp_path, capsys, policy):
    root = _docs_with_bad_line(tmp_path / "data", bad_at=12)
    argv = _argv(tmp_path / "run", "steps=12", "checkpoint.dump.every=2", f"data.root_dir={root}",
                 f"data.on_bad_line={policy}", "data.shuffle_files=false")
    if policy == "skip":
        trainer.main(argv)
        rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
        assert len(rows) == 12 and rows[0]["bad_lines"] == 0 and rows[-1]["bad_lines"] == 1
        return
    with pytest.raises(SystemExit) as e:
        trainer.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "f.jsonl:12: bad record" in err[0], err
    steps = [s for s, _ in _losses(tmp_path / "run")]  # what was done before stays readable
    assert steps == [1, 2, 3, 4, 5, 6]  # step 7 is the first to need line 12
    assert (_ckpt(tmp_path / "run", 6) / MARKER).is_file()


def _config_on_rank(rank, world, argv):
    torch.set_num_threads(1)
    try:
        train(parse_args(TrainArgs, argv + [f"data.seq_len={32 * (rank + 1)}"]))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_ranks_with_different_configs_all_stop_with_the_key_named(tmp_path):
    msgs = run_on_ranks(_config_on_rank, 2, _argv(tmp_path, "steps=2", "distributed.sp_size=2"), timeout_s=120)
    assert all("different configs" in m and "data.seq_len: rank 0 has 32, rank 1 has 64" in m for m in msgs), msgs


# -- a peer that dies or hangs -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_dead_or_hanging_peer_is_an_error_within_the_timeout(tmp_path, fault):
    """2 ranks (env:// like torchrun, SP=2); rank 1 is killed, or stopped (a hang), after step 2. Rank 0
    must exit 1 naming itself and the timeout setting, not wait forever."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "LINGUA_ZECO_FAULT": f"{fault}@2:1"}
        procs.append(_popen(tmp_path, "steps=50", "checkpoint.dump.every=1000", "distributed.sp_size=2",
                            "distributed.timeout_s=5", env=env))
    try:
        t0 = time.monotonic()
        rc, out, err = _finish(procs[0], timeout=150)
        assert rc == 1, (rc, err[-3000:])
        line = err.strip().splitlines()[-1]
        assert line.startswith("error (rank 0): rank 0 of 2: a collective failed or timed out") and \
            "distributed.timeout_s=5" in line, err[-3000:]
        assert time.monotonic() - t0 < 120
        assert [s for s, _ in _losses(tmp_path)][:2] == [1, 2]
    finally:
        for p in procs:
            p.kill()
            p.communicate()


# -- metrics that survive a crash ----------------------------------------------------------------------------
def test_metrics_append_and_survive_a_line_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')  # a crash in the middle of line 2
    logger = MetricLogger(str(tmp_path), LoggingArgs(), active=True)
    logger.log({"step": 2, "loss": 2.5})
    logger.close()
    lines = path.read_text().splitlines()
    assert lines[0] == '{"step": 1, "loss": 3.0}' and lines[1] == '{"step": 2, "lo'  # history untouched
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 3.0), (2, 2.5)]


def test_retention_and_resume_ignore_a_torn_newer_checkpoint(tmp_path, caplog):
    """keep=1 with a torn newer folder (a crash mid-save of a later step): the last complete checkpoint
    survives retention and is the one resumed, with a warning about the torn one."""
    from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager, SaveEvery

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(CheckpointArgs(dump=SaveEvery(every=1, keep=1)), str(tmp_path))
    mgr.save(1, model, opt, extra={"step": 1}, per_rank={})
    os.makedirs(_ckpt(tmp_path, 3))  # torn: no marker
    mgr.save(2, model, opt, extra={"step": 2}, per_rank={})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000000002", "step_0000000003"]
    with caplog.at_level("WARNING"):
        assert mgr.maybe_resume(model, opt)[0] == 2
    assert "torn" in caplog.text


# -- resume and checkpoints --------------------------------------------------------------------
def test_ctrl_c_checkpoints_like_sigterm(tmp_path):
    """SIGINT (Ctrl-C) after step 3: step 4 is saved and the run exits 0, as with SIGTERM."""
    rc, out, err = _finish(_popen(tmp_path, "steps=1000", "checkpoint.dump.every=1000",
                                  env={"LINGUA_ZECO_FAULT": "SIGINT@3"}))
    assert rc == 0 and "KeyboardInterrupt" not in err, err[-2000:]
    assert (_ckpt(tmp_path, 4) / MARKER).is_file() and "stop signal (SIGINT" in out


def test_second_sigusr2_kills_even_when_inherited_as_ignored(tmp_path):
    """A launcher may start the trainer with SIGUSR2 ignored (SIG_IGN is inherited through exec). The
    first SIGUSR2 still asks for a checkpoint; the second must kill at once, not be ignored."""
    def ignore_usr2():
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)

    base = {k: v for k, v in os.environ.items() if k != "LINGUA_ZECO_FAULT"}
    env = {**base, "OMP_NUM_THREADS": "1", "LINGUA_ZECO_FAULT": "SIGUSR2@2,SIGUSR2@2"}
    p = subprocess.Popen([sys.executable, "-m", "apps.gla.train", *_argv(tmp_path, "steps=1000",
                          "checkpoint.dump.every=1000")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=ignore_usr2)
    rc, out, err = _finish(p)
    assert rc == -signal.SIGUSR2, (rc, err[-2000:])
    assert not _ckpt(tmp_path, 3).exists()  # killed before the step boundary that would have saved


def _scribble(folder: Path, fqn: str = "model.model.embeddings.weight"):
    """0xFF over the middle of one tensor's bytes inside its .distcp shard (file size unchanged)."""
    import torch.distributed.checkpoint as dcp

    info = next(v for k, v in dcp.FileSystemReader(str(folder)).read_metadata().storage_data.items() if k.fqn == fqn)
    with open(folder / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        f.write(b"\xff" * 64)


def test_garbage_in_a_shard_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    """Bytes scribbled inside the newest checkpoint's shard: the rerun must notice (checksum), resume from
    the previous checkpoint, and end with finite weights; before, it loaded the NaNs silently, trained on,
    and saved them as COMPLETE while retention deleted the good one."""
    common = ["checkpoint.dump.every=2", "checkpoint.dump.keep=2", "optim.decay_steps=6"]
    train(parse_args(TrainArgs, _argv(tmp_path, *common, "steps=4")))
    _scribble(_ckpt(tmp_path, 4))
    with caplog.at_level("WARNING"):
        res = train(parse_args(TrainArgs, _argv(tmp_path, *common, "steps=6")))
    assert sorted(res["losses"]) == [3, 4, 5, 6], "did not fall back to step 2"
    assert "checksum" in caplog.text and "step_0000000004" in caplog.text
    assert all(math.isfinite(v) for v in res["losses"].values())
    final = dict(_tensors(_state(_ckpt(tmp_path, 6), tmp_path)))
    assert all(torch.isfinite(t).all() for t in final.values() if t.is_floating_point())


def test_second_run_on_the_same_dump_dir_is_refused_while_the_first_lives(tmp_path, capsys):
    """A run holds dump_dir's lock for its lifetime: a second one (a rerun while orphaned workers
    still train) stops at once with one error line and exit 2, touching nothing; once the first is
    dead (kill -9: the kernel drops the lock), the same command runs."""
    first = _popen(tmp_path, "steps=100000", "checkpoint.dump.every=100000")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path / "metrics.jsonl"):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
            time.sleep(0.2)
        config = (tmp_path / "config.yaml").read_text()
        with pytest.raises(SystemExit) as e:
            trainer.main(_argv(tmp_path, "steps=2", "seed=7"))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
        assert "in use" in err[0] and str(tmp_path) in err[0] and f"pid {first.pid}" in err[0], err
        assert (tmp_path / "config.yaml").read_text() == config and first.poll() is None
    finally:
        first.kill()
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    trainer.main(_argv(tmp_path, "steps=2", "checkpoint.dump.every=100000"))


def _need_private_tmpfs(mnt: Path) -> None:
    """Create mnt; skip the test where a tmpfs cannot be mounted in a private mount namespace."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        pytest.skip("needs Linux unshare")
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt}"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")


def _in_mount_namespace(mount_opts: str, mnt: Path, dump_dir: Path, *extra) -> tuple[int, str, str]:
    """The trainer CLI with a fresh tmpfs (mount_opts: ro, or a tiny size) at mnt for its checkpoints,
    in a private mount namespace: a real read-only or full disk, visible to this process only."""
    _need_private_tmpfs(mnt)
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "apps.gla.train",
                                            *_argv(dump_dir, f"checkpoint.path={mnt / 'ckpt'}", *extra)])
    script = f"mount -t tmpfs -o {mount_opts} tmpfs {mnt} && exec {cmd}"
    env = {**{k: v for k, v in os.environ.items() if k != "LINGUA_ZECO_FAULT"}, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)
    return res.returncode, res.stdout, res.stderr


def test_read_only_checkpoint_folder_is_refused_before_training(tmp_path):
    rc, out, err = _in_mount_namespace("ro,size=1m", tmp_path / "mnt", tmp_path / "run", "steps=2",
                                       "checkpoint.dump.every=2")
    lines = err.strip().splitlines()
    assert rc == 2 and lines and lines[-1].startswith("error: ") and "not writable" in lines[-1], err[-3000:]
    assert "read-only file system" in lines[-1].lower() and str(tmp_path / "mnt" / "ckpt") in lines[-1]
    assert "step 1/2" not in out  # found at start, not at the first save


@pytest.mark.parametrize("size", ["160k", "200k"])
def test_full_disk_at_save_is_named_no_space_left(tmp_path, size):
    """A tiny tmpfs: the start probe fits, the first checkpoint (~0.8 MB) does not. The failure must say
    "no space left on device" in one line. (With torch 2.13, 160k fails in DCP's open, errno 28; 200k in
    torch.save's zip writer, whose "unexpected pos" message has lost the errno.)"""
    rc, out, err = _in_mount_namespace(f"size={size}", tmp_path / "mnt", tmp_path / "run", "steps=3",
                                       "checkpoint.dump.every=2")
    lines = err.strip().splitlines()
    assert rc == 1 and lines and lines[-1].startswith("error: "), err[-3000:]
    assert "no space left on device" in lines[-1].lower() and "unexpected pos" not in err, err[-3000:]
    assert "step 2/3" in out and "step 3/3" not in out


# -- nothing lost, nothing misreported -----------------------------------------------------------
def _wait_for_metrics(p: subprocess.Popen, dump_dir: Path) -> None:
    deadline = time.monotonic() + 120
    while not (dump_dir / "metrics.jsonl").exists() or not read_metrics(dump_dir / "metrics.jsonl"):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
        time.sleep(0.2)


def _one_error(capsys, argv, code=2) -> str:
    with pytest.raises(SystemExit) as e:
        trainer.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == code and len(err) == 1 and err[0].startswith("error: "), (e.value.code, err)
    return err[0]


def test_a_shared_checkpoint_path_is_locked_and_never_resumed_by_another_run(tmp_path, capsys):
    """Two dump_dirs, one checkpoint.path (item 2): while the first runs the second stops at once (it
    would have removed the first's unfinished save); afterwards the second refuses the first's
    checkpoints instead of resuming them silently. The first run, its dump_dir moved, still resumes."""
    shared = tmp_path / "shared"
    first = _popen(tmp_path / "a", "steps=100000", "checkpoint.dump.every=100000", f"checkpoint.path={shared}")
    try:
        _wait_for_metrics(first, tmp_path / "a")
        line = _one_error(capsys, _argv(tmp_path / "b", "steps=2", f"checkpoint.path={shared}"))
        assert "in use" in line and "checkpoint.path" in line and str(shared) in line and f"pid {first.pid}" in line
        assert not (tmp_path / "b" / "metrics.jsonl").exists()
    finally:
        first.kill()
        first.communicate()
    done = tmp_path / "done"
    trainer.main(_argv(tmp_path / "c", "steps=2", "checkpoint.dump.every=2", f"checkpoint.path={done}"))
    line = _one_error(capsys, _argv(tmp_path / "d", "steps=4", f"checkpoint.path={done}"))
    assert "another run" in line and str(tmp_path / "c") in line and "init_ckpt_path" in line, line
    assert not (tmp_path / "d" / "metrics.jsonl").exists()
    (tmp_path / "c").rename(tmp_path / "moved")
    res = train(parse_args(TrainArgs, _argv(tmp_path / "moved", "steps=4", "checkpoint.dump.every=2",
                                            f"checkpoint.path={done}")))
    assert sorted(res["losses"]) == [3, 4]


def _dump_dir_on_tmpfs(tmp_path: Path, size: str, fill: bool, *extra) -> tuple[int, str, str, Path]:
    """The trainer CLI with dump_dir on a tmpfs of `size` (full at start with `fill`) in a private mount
    namespace, its checkpoints on tmp_path/ckpt (room); the dump_dir is copied to tmp_path/run after."""
    mnt = tmp_path / "mnt"
    _need_private_tmpfs(mnt)
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "apps.gla.train",
                                            *_argv(mnt / "run", f"checkpoint.path={tmp_path / 'ckpt'}", *extra)])
    filler = f"head -c 10M /dev/zero > {mnt}/fill 2>/dev/null;" if fill else ""
    script = (f"mount -t tmpfs -o size={size} tmpfs {mnt} && {filler} {cmd}; rc=$?; "
              f"cp -a {mnt}/run {tmp_path}/run 2>/dev/null; exit $rc")
    env = {**{k: v for k, v in os.environ.items() if k != "LINGUA_ZECO_FAULT"}, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180, check=False)
    return res.returncode, res.stdout, res.stderr, tmp_path / "run"


def test_full_disk_at_start_is_one_error_line(tmp_path):
    """dump_dir on a full disk (item 3): the lock file is created but cannot be written: the documented
    `error:` line and exit 2, not a traceback."""
    rc, _, err, _ = _dump_dir_on_tmpfs(tmp_path, "64k", True, "steps=2")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err[-3000:])
    assert "no space left on device" in lines[0].lower() and "dump_dir" in lines[0], lines


def test_full_disk_for_the_metrics_saves_a_checkpoint_and_loses_nothing(tmp_path):
    """dump_dir's disk fills up mid-run while the checkpoint disk has room (item 3): no half-written JSON
    line, a checkpoint of the step whose record could not be written, one error line (exit 1); after
    space is freed, the same run resumes from that step and metrics.jsonl holds every step once."""
    common = ["steps=60", "checkpoint.dump.every=1000"]
    # 4 pages: .lock, .run_id, config.yaml, and one of metrics (about 10 records)
    rc, _, err, run = _dump_dir_on_tmpfs(tmp_path, "16k", False, *common)
    lines = err.strip().splitlines()
    assert rc == 1 and lines and lines[-1].startswith("error: ") and "Traceback" not in err, err[-3000:]
    assert "metrics" in lines[-1] and "no space left on device" in lines[-1].lower(), lines[-1]
    text = (run / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]  # every line whole
    last = rows[-1]["step"]
    assert text.endswith("\n") and [r["step"] for r in rows] == list(range(1, last + 1)) and last < 60
    assert f"step_{last + 1:010d}" in lines[-1] and (tmp_path / "ckpt" / f"step_{last + 1:010d}" / MARKER).is_file()
    rc, out, err = _finish(_popen(run, *common, f"checkpoint.path={tmp_path / 'ckpt'}"))
    assert rc == 0 and f"start at step {last + 1}" in out, err[-2000:]
    assert [s for s, _ in _losses(run)] == [s for s in range(1, 61) if s != last + 1]


def test_clean_exit_frees_process_groups_left_in_reference_cycles():
    # CI caught `apps.gla.eval` aborting (exit 134, "terminate called without an active exception") after
    # printing its result, about one run in three: its model held the SP group in a reference cycle, so the
    # group was freed during interpreter shutdown, when gloo's worker threads can no longer take the GIL
    import gc
    import weakref

    from lingua_zeco import distributed
    from lingua_zeco.reliability import clean_exit

    was_enabled = gc.isenabled()
    gc.disable()  # only clean_exit's own collection may free the cycle
    try:
        with clean_exit():
            env = distributed.setup(distributed.DistributedArgs())
            cycle = {"group": env.sp.group}
            cycle["self"] = cycle
            group = weakref.ref(env.sp.group)
            distributed.teardown(env)
            del env, cycle
            assert group() is not None  # held by the cycle until collected
        assert group() is None
    finally:
        if was_enabled:
            gc.enable()
