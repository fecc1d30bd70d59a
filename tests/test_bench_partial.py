"""bench_main (apps/gla/bench/common.py) writes a generator's results as they come: a benchmark cut
short by a time limit (a device call's, a SLURM job's) keeps every measurement it finished."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

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


def test_a_variant_out_of_memory_gets_its_row_and_the_others_run(tmp_path, monkeypatch, capsys):
    """bench_train: the first variant runs out of memory (as fla's model did at 32K on an 80 GB GPU); its row
    says so, the next variant is measured in the memory it held, and the exit code is 1."""
    import apps.gla.bench.bench_train as bench_train

    real = bench_train.run_variant

    def run_variant(name, a, device):
        if name == "ours_float8":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB")
        return real(name, a, device)

    monkeypatch.setattr(bench_train, "run_variant", run_variant)
    argv = ["config=debug.yaml", "variants=ours_float8,ours", "seq_len=64", "steps=2", "warmup=1", f"out={tmp_path}",
            "stem=oom"]
    assert bench_train.cli(argv) == 1
    rows = json.loads((tmp_path / "oom.json").read_text())["rows"]
    assert rows[0] == dict(variant="ours_float8", seq_len=64, error="out of memory at seq_len=64", vs_fla=None)
    assert rows[1]["variant"] == "ours" and rows[1]["tok_per_s"] > 0 and "error" not in rows[1]
    assert "error: variant ours_float8 ran out of memory" in capsys.readouterr().out
    assert "| out of memory at seq_len=64 |" in (tmp_path / "oom.md").read_text()
    monkeypatch.setattr(bench_train, "run_variant", real)
    assert bench_train.cli([*argv, "variants=ours", "stem=whole"]) == 0
