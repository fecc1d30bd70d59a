"""gc.every (lingua_zeco/profiling.py): automatic collection off in the loop, a young-generation
collection every N steps; counted through gc.callbacks, which report every collection the interpreter runs."""
from __future__ import annotations

import gc
import logging

import pytest

from lingua_zeco.args import ConfigError
from lingua_zeco.profiling import GCArgs, collecting


@pytest.fixture
def collections():
    """The generation of every collection started while the fixture is active, and whether automatic
    collection was on at the time."""
    seen = []

    def record(phase, info):
        if phase == "start":
            seen.append((info["generation"], gc.isenabled()))
    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)


def test_collects_every_n_steps_with_automatic_collection_off(collections, caplog):
    assert gc.isenabled()
    with caplog.at_level(logging.DEBUG, logger="lingua_zeco.profiling"), collecting(GCArgs(every=3)) as sched:
        assert not gc.isenabled()
        assert collections == [(2, False)]  # one full collection at the start
        by_step = {}
        for step in range(1, 10):
            garbage = [[i] for i in range(2000)]  # would set off automatic collections if they were on
            del garbage
            before = len(collections)
            sched.step(step)
            by_step[step] = [g for g, _ in collections[before:]]
    assert gc.isenabled()  # as it was before
    assert {s: g for s, g in by_step.items() if g} == {3: [1], 6: [1], 9: [1]}
    assert [g for g, _ in collections] == [2, 1, 1, 1]
    assert sum("generation 1 collection at step" in r.message for r in caplog.records) == 3


def test_zero_leaves_python_s_automatic_collection_alone(collections):
    with collecting(GCArgs(every=0)) as sched:
        assert gc.isenabled()
        for step in range(1, 5):
            garbage = [[i] for i in range(5000)]
            del garbage
            sched.step(step)
    assert gc.isenabled()
    assert collections and all(on for _, on in collections)  # only the interpreter's own, as without gc.every


def test_negative_every_is_a_config_error():
    with pytest.raises(ConfigError, match=r"gc.every=-1 must be >= 0"):
        with collecting(GCArgs(every=-1)):
            pass


def test_trainer_collects_at_the_configured_steps(tmp_path, collections):
    from apps.gla.train import TrainArgs, train
    from lingua_zeco.args import parse_args

    argv = ["config=debug.yaml", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_hidden=64",
            "data.batch_size=1", "data.seq_len=32", "data.prefetch=0", "steps=5", "logging.freq=100",
            "checkpoint.dump.every=0", "gc.every=2", f"dump_dir={tmp_path}"]
    train(parse_args(TrainArgs, argv))
    assert gc.isenabled()
    in_loop = [g for g, on in collections if not on]  # automatic collection off: the loop's own
    assert in_loop == [2, 1, 1], collections  # the start, after steps 2 and 4
