"""Asynchronous checkpoint saves (checkpoint.async_save, lingua_zeco/checkpoint/async_save.py): what loads
equals a synchronous save of the same state, COMPLETE appears only once finalised, a kill during the
background write leaves the previous checkpoint, exact resume, and 2 gloo ranks agreeing on when to
finalise."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import time

import pytest
import torch

from lingua_zeco.checkpoint import MARKER, WRITE_DELAY_ENV, CheckpointArgs, CheckpointManager, SaveEvery
from lingua_zeco.checkpoint import integrity  # white-box: patched below
from lingua_zeco.reliability import StorageError
from local_ranks import run_on_ranks
from test_checkpoint import _model, _opt, _same_optim, _same_params, _sharded, _train
from test_reliability import _ckpt, _finish, _losses, _popen, _same, _state


def _mgr(root, async_save=True, keep=0, timeout_s=None):
    return CheckpointManager(CheckpointArgs(dump=SaveEvery(every=1, keep=keep), async_save=async_save), str(root),
                             timeout_s=timeout_s)


def _snapshot(m, o) -> tuple[dict, dict]:
    return ({k: v.clone() for k, v in m.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in o.state_dict()["state"].items()})


def _equals_snapshot(m, o, snap) -> bool:
    params, state = snap
    got = o.state_dict()["state"]
    return (all(torch.equal(v, params[k]) for k, v in m.state_dict().items()) and got.keys() == state.keys()
            and all(torch.equal(got[i][k], state[i][k]) for i in state for k in state[i]))


def test_async_save_loads_bitwise_like_a_sync_save(tmp_path, monkeypatch):
    """The same state saved both ways; training goes on while the asynchronous write is held back, so a
    write that read the live tensors instead of the staged copy would hold the later state."""
    m = _model(0)
    o = _opt(m)
    _train(m, o, 3)
    snap = _snapshot(m, o)
    extra, per_rank = {"step": 3, "sched": {"last_epoch": 3}}, {"data": {"pos": torch.arange(4)}}
    _mgr(tmp_path / "sync", async_save=False).save(3, m, o, extra=extra, per_rank=per_rank)
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.3")
    mgr = _mgr(tmp_path / "async")
    mgr.save(3, m, o, extra=extra, per_rank=per_rank)
    _train(m, o, 2, seed=7)  # the next steps, while the write is pending
    assert not _equals_snapshot(m, o, snap)
    assert mgr.wait().endswith("step_0000000003")
    loaded = []
    for root in ("sync", "async"):
        m2 = _model(5)
        o2 = _opt(m2)
        step, ex, pr = _mgr(tmp_path / root).maybe_resume(m2, o2)
        assert (step, ex) == (3, extra) and torch.equal(pr["data"]["pos"], torch.arange(4))
        loaded.append((m2, o2))
    (ms, os_), (ma, oa) = loaded
    assert _same_params(ms, ma) and _same_optim(os_, oa), "async and sync checkpoints differ"
    assert _equals_snapshot(ma, oa, snap), "the async checkpoint is not the state at save time"
    mgr.close()


def test_complete_marker_only_after_finalisation(tmp_path, monkeypatch):
    """Written, not yet finalised: a .tmp_step_* folder that discovery skips. poll() finalises once the write
    is done, the next save finalises a pending one first, close() the last; the marker's checksums hold."""
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.4")
    m = _model(0)
    o = _opt(m)
    mgr = _mgr(tmp_path, keep=2)
    final = mgr.save(1, m, o, extra={"step": 1}, per_rank={})
    assert os.path.isdir(os.path.join(mgr.path, ".tmp_step_0000000001")) and not os.path.exists(final)
    assert mgr.latest_complete() is None and mgr.poll() is None  # the write is held back 0.4 s
    deadline = time.monotonic() + 60
    while (done := mgr.poll()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done == final
    marker = json.load(open(os.path.join(final, MARKER)))
    assert marker["finite"] is True and marker["step"] == 1
    assert sorted(marker["files"]) == sorted(n for n in os.listdir(final) if n != MARKER)
    assert integrity.verify(final, marker["files"], 0, 1) == []
    for step in (2, 3):  # save 3 starts by finalising 2
        _train(m, o, 1, seed=step)
        mgr.save(step, m, o, extra={"step": step}, per_rank={})
    assert [s for s, _ in mgr.complete_checkpoints()] == [1, 2]
    assert mgr.close().endswith("step_0000000003")
    assert [s for s, _ in mgr.complete_checkpoints()] == [2, 3]  # keep=2: retention ran at finalisation
    assert not [n for n in os.listdir(mgr.path) if n.startswith(".tmp")]


def test_failed_background_write_raises_at_finalisation_and_keeps_the_previous(tmp_path, monkeypatch):
    m = _model(0)
    o = _opt(m)
    mgr = _mgr(tmp_path)
    mgr.save(1, m, o, extra={"step": 1}, per_rank={})
    mgr.wait()

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(integrity, "checksums", broken)  # called in the background thread, after DCP's write
    mgr.save(2, m, o, extra={"step": 2}, per_rank={})
    with pytest.raises(StorageError, match=r"step 2 .*no space left on device.*step_0000000001"):
        mgr.wait()
    assert [s for s, _ in mgr.complete_checkpoints()] == [1] and os.listdir(mgr.path) == ["step_0000000001"]


# -- a kill during the background write; exact resume ---------------------------------------------------
def test_kill_during_background_write_resumes_from_the_previous_checkpoint_bitwise(tmp_path):
    """SIGKILL right after save 8 returned, while its write is held back: step 8 stays a .tmp folder, the
    rerun resumes from step 4 and steps 5-12 (losses, final model and optimizer) equal an uninterrupted
    synchronous run bit for bit."""
    common = ["steps=12", "checkpoint.dump.every=4", "checkpoint.dump.keep=0"]
    ref = _popen(tmp_path / "ref", *common, "checkpoint.async_save=false")
    cut = _popen(tmp_path / "cut", *common, "checkpoint.async_save=true",
                 env={"LINGUA_ZECO_FAULT": "SIGKILL@8", WRITE_DELAY_ENV: "1"})
    rc, out, err = _finish(cut)
    assert rc == -signal.SIGKILL, err[-2000:]
    torn = _ckpt(tmp_path / "cut", 8).parent / ".tmp_step_0000000008"
    assert (_ckpt(tmp_path / "cut", 4) / MARKER).is_file() and not _ckpt(tmp_path / "cut", 8).exists()
    assert (torn / "rank0.pt").is_file() and not (torn / MARKER).exists()  # started, never finalised
    rc, out, err = _finish(_popen(tmp_path / "cut", *common, "checkpoint.async_save=true"))
    assert rc == 0 and "start at step 4" in out, err[-2000:]
    rc, _, err = _finish(ref)
    assert rc == 0, err[-2000:]
    full, cut_rows = dict(_losses(tmp_path / "ref")), _losses(tmp_path / "cut")
    assert [s for s, _ in cut_rows] == list(range(1, 13))  # steps 5-8 once: the rerun replaced them
    assert cut_rows[4:] == [(s, full[s]) for s in range(5, 13)]  # exact float equality
    assert _same(_state(_ckpt(tmp_path / "ref", 12), tmp_path), _state(_ckpt(tmp_path / "cut", 12), tmp_path)) == []
    assert not torn.exists()  # the next save cleared it


# -- 2 gloo ranks -------------------------------------------------------------------------------------
def _two_ranks(rank, world, root):
    """Rank 1's write is held back: both ranks must finalise at the same poll (a rank finalising alone
    would wait in a collective the other never joins). Plain and FSDP2 models; async equals sync."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))


    def full(mod):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in mod.state_dict().items()}

    if rank == 1:
        os.environ[WRITE_DELAY_ENV] = "0.5"
    out = {}
    for kind, make in (("plain", _model), ("fsdp", lambda seed: _sharded(seed, mesh))):
        m = make(0)
        o = _opt(m)
        _train(m, o, 2)
        saved = full(m)
        _mgr(os.path.join(root, kind, "sync"), async_save=False).save(2, m, o, extra={"step": 2}, per_rank={"r": rank})
        mgr = _mgr(os.path.join(root, kind, "async"), timeout_s=60)
        mgr.save(2, m, o, extra={"step": 2}, per_rank={"r": rank})
        polls = 0
        while (done := mgr.poll()) is None and polls < 5000:  # training goes on meanwhile
            polls += 1
            _train(m, o, 1, seed=polls)
            time.sleep(0.01)
        mgr.close()
        loaded = []
        for mode in ("sync", "async"):
            m2 = make(4)
            o2 = _opt(m2)
            step, extra, pr = _mgr(os.path.join(root, kind, mode)).maybe_resume(m2, o2)
            loaded.append(full(m2))
        same_as_sync = all(torch.equal(v, loaded[0][k]) for k, v in loaded[1].items())
        same_as_saved = all(torch.equal(v, saved[k]) for k, v in loaded[1].items())
        out[kind] = (polls, done is not None, step, extra, pr, same_as_sync, same_as_saved)
    return out


def test_two_gloo_ranks_finalise_together(tmp_path):
    res = run_on_ranks(_two_ranks, 2, str(tmp_path), timeout_s=180)
    for kind in ("plain", "fsdp"):
        (p0, *rest0), (p1, *rest1) = res[0][kind], res[1][kind]
        assert p0 == p1 and p0 > 0, (kind, p0, p1)  # the same poll on both ranks; rank 0 waited for rank 1
        for rank, rest in enumerate((rest0, rest1)):
            assert rest == [True, 2, {"step": 2}, {"r": rank}, True, True], (kind, rank, rest)


def test_stop_signal_finalises_the_last_save_before_the_trainer_returns(tmp_path, monkeypatch):
    """SIGUSR2 after step 3: step 4 is saved asynchronously, and complete once train() returns."""
    from apps.gla.train import TrainArgs, train
    from lingua_zeco.args import parse_args
    from test_reliability import _argv

    monkeypatch.setenv("LINGUA_ZECO_FAULT", "SIGUSR2@3")
    argv = _argv(tmp_path, "steps=1000", "checkpoint.dump.every=1000", "checkpoint.async_save=true")
    assert train(parse_args(TrainArgs, argv))["step"] == 4
    assert (_ckpt(tmp_path, 4) / MARKER).is_file()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [".lock", "step_0000000004"]  # .lock: checkpoint/run_dir.py


def test_stager_keeps_its_buffers_and_copy_table_across_saves():
    """DCP (torch 2.11) closes the stager after each stage; ours must still stage the next save into the
    same host buffers, including a state holding a class object (DefaultStager: KeyError: <class 'type'>)."""
    from lingua_zeco.checkpoint.async_save import _KeptStager
    stager = _KeptStager(cuda=False)
    state = {"w": torch.randn(64), "group": {"kind": torch.nn.Linear, "lr": 0.1}}
    first = stager.stage(state)
    stager.close()  # what DCP may do after every save
    state["w"].add_(1.0)
    second = stager.stage(state)
    assert second["group"]["kind"] is torch.nn.Linear and torch.equal(second["w"], state["w"])
    assert second["w"].untyped_storage().data_ptr() == first["w"].untyped_storage().data_ptr(), "buffers not reused"
    assert second["w"].data_ptr() != state["w"].data_ptr(), "a staged copy must not alias the live tensor"
    stager.release()


def test_prepared_host_buffers_are_the_ones_every_save_copies_into(tmp_path):
    """prepare() allocates (on CUDA pins) the host buffers once, before the first save: the first save then
    only copies, like the later ones (the first save used to stall for the allocation)."""
    m = _model(0)
    o = _opt(m)
    _train(m, o, 1)
    mgr = _mgr(tmp_path)
    mgr.prepare(m, o)
    prepared = dict(mgr._async._stager.buffers)
    state_bytes = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    assert sum(prepared.values()) >= 3 * state_bytes  # weights and AdamW's two moments
    assert mgr.take_stall() > 0 and mgr.take_stall() == 0
    for step in (1, 2):
        _train(m, o, 1, seed=step)
        mgr.save(step, m, o, extra={"step": step}, per_rank={})
        assert mgr._async._stager.buffers == prepared, "a save allocated new host buffers"
        mgr.wait()
    mgr.close()


def test_a_save_waiting_for_the_previous_write_is_logged_and_counted(tmp_path, monkeypatch, caplog):
    """A save that starts while the previous background write still runs blocks the loop: say so, with
    the cause, and count the seconds."""
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.4")
    m = _model(0)
    o = _opt(m)
    _train(m, o, 1)
    mgr = _mgr(tmp_path)
    mgr.save(1, m, o, extra={"step": 1}, per_rank={})
    mgr.take_stall()
    with caplog.at_level(logging.INFO):
        mgr.save(2, m, o, extra={"step": 2}, per_rank={})
    assert "waited" in caplog.text and "background write of step 1" in caplog.text, caplog.text
    assert mgr.take_stall() >= 0.5  # the held write (0.4 s before writing, 0.4 s before hashing)
    mgr.close()


def test_the_trainer_logs_and_counts_checkpoint_stalls(tmp_path, monkeypatch, caplog):
    """Saves every step with held background writes: each save waits for the previous write. The log
    says so with the cause, and metrics.jsonl counts the seconds (ckpt_stall_s), which the step time
    leaves out; the host buffers are allocated once, after the first step."""
    from apps.gla.train import TrainArgs, train
    from lingua_zeco.args import parse_args
    from lingua_zeco.metrics import read_metrics
    from test_reliability import _argv

    monkeypatch.setenv(WRITE_DELAY_ENV, "1")  # longer than a step: a save finds the previous write running
    argv = _argv(tmp_path, "steps=4", "checkpoint.dump.every=1", "checkpoint.async_save=true")
    with caplog.at_level(logging.INFO):
        train(parse_args(TrainArgs, argv))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[0]["ckpt_stall_s"] == 0
    waits = re.findall(r"checkpoint of step (\d): the loop waited ([\d.]+)s for the background write", caplog.text)
    reported = [float(w) for s, w in waits if int(s) < 4]  # save 4's stall comes after the last record
    assert reported and max(r["ckpt_stall_s"] for r in rows[2:]) >= max(reported) - 0.05, (waits, rows)  # %.1f
    assert caplog.text.count("host buffers allocated") == 1
