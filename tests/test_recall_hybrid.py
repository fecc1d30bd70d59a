"""apps.gla.recall_hybrid on an out= folder it already used: the same settings resume the runs there; other
settings are refused with one line naming them, instead of the earlier runs' numbers reported under the
new settings. Tiny runs (1 rank, 2 steps); the real comparison is tests/test_hybrid.py's slow test."""
from __future__ import annotations

import json

import pytest

from test_entry_points import assert_one_error_line, run_cases


def test_other_settings_on_a_used_out_are_refused_not_reported(tmp_path):
    from apps.gla import recall_hybrid
    from lingua_zeco.args import ConfigError, parse_args

    tiny = [f"out={tmp_path}", "sp_size=1", "steps=2", "last=1",
            "overrides=[logging.freq=1,data.batch_size=2,data.mqar.n_queries=8]"]  # 8 queries fit one rank
    recall_hybrid.main(tiny)
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}
    assert json.loads((tmp_path / "recall_hybrid.json").read_text())["args"]["steps"] == 2  # settings kept

    (code, err), = run_cases([("apps.gla.recall_hybrid", [*tiny, "steps=3", "softmax_sp=ring", "last=2"])])
    assert_one_error_line(code, err, "steps: saved 2, now 3")
    assert "softmax_sp: saved 'allgather', now 'ring'" in err and "last" not in err.split("(")[1], err
    assert {p: p.read_bytes() for p in files} == files  # nothing trained, nothing rewritten

    recall_hybrid.check_out(parse_args(recall_hybrid.RecallHybridArgs, [*tiny, "last=2"]))  # same runs: resumed
    (tmp_path / "recall_hybrid.json").unlink()  # runs whose settings are unknown
    with pytest.raises(ConfigError, match="no recall_hybrid.json"):
        recall_hybrid.check_out(parse_args(recall_hybrid.RecallHybridArgs, tiny))
    with pytest.raises(ConfigError, match="last=0: set last to 1 or more"):
        recall_hybrid.run(parse_args(recall_hybrid.RecallHybridArgs, [*tiny, "last=0"]))
