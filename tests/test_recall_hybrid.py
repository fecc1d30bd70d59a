"""apps.gla.recall_hybrid on an out= folder it already used: the same settings resume the runs there; other
settings are refused with one line naming them, instead of the earlier runs' numbers reported under the
new settings. Tiny runs (1 rank, 2 steps); the real comparison is tests/test_hybrid.py's slow test."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_entry_points import assert_one_error_line, run_cases


def test_other_settings_on_a_used_out_are_refused_not_reported(tmp_path):
    from apps.gla import recall_hybrid
    from lingua_zeco.args import ConfigError, parse_args

    config = tmp_path / "mqar.yaml"  # a config file of the user's, edited below
    config.write_text((Path(__file__).parents[1] / "configs" / "mqar_hybrid.yaml").read_text())
    tiny = [f"out={tmp_path}", "sp_size=1", "steps=2", "last=1", f"config={config}",
            "overrides=[logging.freq=1,data.batch_size=2,data.mqar.n_queries=8]"]  # 8 queries fit one rank
    recall_hybrid.main(tiny)
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}
    assert json.loads((tmp_path / "recall_hybrid.json").read_text())["args"]["steps"] == 2  # settings kept

    (code, err), = run_cases([("apps.gla.recall_hybrid", [*tiny, "steps=3", "softmax_sp=ring", "last=2"])])
    assert_one_error_line(code, err, "steps: saved 2, now 3")
    assert "softmax_sp: saved 'allgather', now 'ring'" in err and "last" not in err.split("(")[1], err
    assert {p: p.read_bytes() for p in files} == files  # nothing trained, nothing rewritten

    recall_hybrid.check_out(parse_args(recall_hybrid.RecallHybridArgs, [*tiny, "last=2"]))  # same runs: resumed
    config.write_text(config.read_text().replace("lr: 1.0e-2", "lr: 5.0e-2"))  # the same name, other contents
    with pytest.raises(ConfigError, match=r"other settings \(gla: optim.lr: saved 0.01, now 0.05; hybrid: optim.lr"):
        recall_hybrid.check_out(parse_args(recall_hybrid.RecallHybridArgs, tiny))
    (tmp_path / "recall_hybrid.json").unlink()  # runs whose settings are unknown
    with pytest.raises(ConfigError, match="no recall_hybrid.json"):
        recall_hybrid.check_out(parse_args(recall_hybrid.RecallHybridArgs, tiny))
    with pytest.raises(ConfigError, match="last=0: set last to 1 or more"):
        recall_hybrid.run(parse_args(recall_hybrid.RecallHybridArgs, [*tiny, "last=0"]))


def test_bad_trainer_keys_are_one_line_and_leave_nothing(tmp_path):
    """A trainer key the parent's check refuses (model.dim=0), and one only a rank's run finds (a missing init
    checkpoint): one error line each, exit 2, and no out= folder left behind."""
    cases = [("apps.gla.recall_hybrid", [f"out={tmp_path}/{name}", "sp_size=2", "steps=1", f"overrides=[{bad}]"])
             for name, bad in (("dim", "model.dim=0"), ("init", f"checkpoint.init_ckpt_path={tmp_path}/nothing"))]
    (code, err), (code2, err2) = run_cases(cases)
    assert_one_error_line(code, err, "model.dim=0 must be >= 1")
    assert_one_error_line(code2, err2, f"checkpoint '{tmp_path}/nothing'")
    assert list(tmp_path.iterdir()) == []
