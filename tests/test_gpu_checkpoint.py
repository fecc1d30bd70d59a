"""Asynchronous checkpoints of a CUDA model (pytest -m gpu): pinned host buffers, reused save after save.

On the GPU image's torch 2.11 the second asynchronous save of a run failed (`KeyError: <class 'type'>`,
measured with bench_checkpoint on GLA-1B) while the CPU suite, without pinned buffers and on
another torch, passed: several saves in a row, each loaded back and compared, are what catches it.
"""
import pytest
import torch

from lingua_zeco.checkpoint import CheckpointArgs, CheckpointManager, SaveEvery
from test_checkpoint_async import _equals_snapshot, _snapshot

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model(seed):
    torch.manual_seed(seed)  # 4 MiB weights: above the stager's pinning threshold
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 8)).cuda()


def _train(model, opt, steps, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 1024, generator=g, device="cuda")).pow(2).mean().backward()
        opt.step()


def test_consecutive_async_saves_load_the_state_of_their_step(tmp_path):
    m = _model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    mgr = CheckpointManager(CheckpointArgs(dump=SaveEvery(every=1, keep=0), async_save=True), str(tmp_path))
    _train(m, opt, 1, seed=0)
    mgr.prepare(m, opt)  # pinned buffers allocated once, before the first save (as the trainer does)
    prepared = dict(mgr._async._stager.buffers)
    saved = {}
    for step in (1, 2, 3):
        _train(m, opt, 2, seed=step)
        saved[step] = _snapshot(m, opt)
        mgr.save(step, m, opt, extra={"step": step}, per_rank={})
        assert mgr._async._stager.buffers == prepared, "a save allocated new host buffers"
        _train(m, opt, 1, seed=10 + step)  # training goes on during the background write
    mgr.close()
    done = mgr.complete_checkpoints()
    assert [s for s, _ in done] == [1, 2, 3]
    for step, folder in done:
        m2 = _model(7)
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
        _train(m2, o2, 1, seed=0)  # optimizer state exists, with other values
        extra, _ = mgr.load(folder, m2, o2)
        assert extra["step"] == step and _equals_snapshot(m2, o2, saved[step]), f"step {step} did not round-trip"
