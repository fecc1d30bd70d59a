"""bench_main (apps/gla/bench/common.py) writes a generator's results as they come: a benchmark cut
short by a time limit (a device call's, a SLURM job's) keeps every measurement it finished."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from apps.gla.bench.common import bench_main, finish


@dataclass
class _Args:
    out: str = ""
    rows: int = 3


class _Cut(Exception):
    pass


def _rows(args):
    rows = []
    for i in range(args.rows):
        rows.append(dict(i=i))
        yield "partial_demo", dict(rows=rows), "| i |\n|---|\n" + "".join(f"| {r['i']} |\n" for r in rows)


def _measure(args, device):
    yield from _rows(args)
    raise _Cut("the time limit")  # what a timeout does to a run: no final write


def _measure_whole(args, device):
    yield from _rows(args)


@pytest.fixture(autouse=True)
def _no_group_left():
    yield
    finish()  # the cut run never reached its own: the one-process group must not outlive the test


def test_a_run_cut_short_keeps_what_it_measured(tmp_path):
    with pytest.raises(_Cut):
        bench_main(_Args, _measure)([f"out={tmp_path}"])
    written = json.loads((tmp_path / "partial_demo.json").read_text())
    assert written["partial"] is True and [r["i"] for r in written["rows"]] == [0, 1, 2]
    assert "| 2 |" in (tmp_path / "partial_demo.md").read_text()


def test_a_whole_run_is_not_marked_partial(tmp_path):
    path = bench_main(_Args, _measure_whole)([f"out={tmp_path}", "rows=2"])
    written = json.loads(open(path).read())
    assert "partial" not in written and [r["i"] for r in written["rows"]] == [0, 1]
