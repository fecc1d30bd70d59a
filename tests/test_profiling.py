"""profiling.memory_snapshot (lingua_zeco/profiling.py): the CUDA allocator's history over the profiler's
window. On a CPU: one warning and the run goes on; the window, the file names and the checks of the keys.
On CUDA (skipped here): the pickle is written at the window's end."""
from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest
import torch

from lingua_zeco.args import ConfigError
from lingua_zeco.profiling import ProfilerArgs, maybe_profile, snapshot_path, snapshot_window


@pytest.mark.filterwarnings("ignore:Profiler won.t be using warmup")
@pytest.mark.parametrize("start,warmup,active", [(0, 0, 1), (10, 1, 3), (2, 0, 2)])
def test_snapshot_window_is_the_profiler_s(start, warmup, active):
    """Steps recorded = the steps torch.profiler's schedule warms up or records (1-based step k is action k-1)."""
    schedule = torch.profiler.schedule(skip_first=start, wait=0, warmup=warmup, active=active, repeat=1)
    profiled = [k + 1 for k in range(start + warmup + active + 5)
                if schedule(k) != torch.profiler.ProfilerAction.NONE]
    begin, end = snapshot_window(ProfilerArgs(start_step=start, warmup=warmup, active=active))
    assert list(range(begin + 1, end + 1)) == profiled


def test_snapshot_file_names():
    assert snapshot_path(Path("d/profile"), 3, 14) == Path("d/profile/memory_snapshot_rank3_step14.pickle")


@pytest.mark.parametrize("key,value,least", [("start_step", -1, 0), ("warmup", -2, 0), ("active", 0, 1),
                                             ("memory_snapshot_entries", 0, 1)])
def test_bad_window_keys_are_named(key, value, least, tmp_path):
    args = ProfilerArgs(memory_snapshot=True, **{key: value})
    with pytest.raises(ConfigError, match=rf"^profiling\.{key}={value} must be >= {least}$"):
        with maybe_profile(args, str(tmp_path), 0):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour")
def test_cpu_run_warns_once_and_goes_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lingua_zeco.profiling"):
        with maybe_profile(ProfilerArgs(memory_snapshot=True, start_step=0, warmup=0, active=2), str(tmp_path), 0) as p:
            for _ in range(3):
                p.step()
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "profiling.memory_snapshot needs CUDA" in warnings[0]
    assert not list(tmp_path.rglob("*.pickle"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("trace", [False, True])
def test_cuda_snapshot_written_at_the_window_s_end(tmp_path, trace):
    args = ProfilerArgs(enabled=trace, memory_snapshot=True, start_step=1, warmup=1, active=1)
    with maybe_profile(args, str(tmp_path), 0) as p:
        for step in range(1, 5):
            x = torch.randn(1024, 1024, device="cuda") @ torch.randn(1024, 1024, device="cuda")
            del x
            p.step()
            if step == 3:
                assert snapshot_path(tmp_path / "profile", 0, 3).is_file()
    assert [f.name for f in (tmp_path / "profile").glob("*.pickle")] == ["memory_snapshot_rank0_step3.pickle"]
    with open(snapshot_path(tmp_path / "profile", 0, 3), "rb") as f:
        assert pickle.load(f)["device_traces"]
