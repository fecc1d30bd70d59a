"""Run logging: plain files only (wandb disabled), wandb offline without network, the metrics plot."""
from __future__ import annotations

import json
import os
import socket

import pytest

from apps.gla import plot_metrics
from lingua_zeco.metrics import LoggingArgs, MetricLogger, read_metrics


def test_plain_files_mode(tmp_path):
    m = MetricLogger(str(tmp_path), LoggingArgs(wandb="disabled"), active=True)
    m.log({"step": 1, "loss": 2.5})
    m.close()
    again = MetricLogger(str(tmp_path), LoggingArgs(wandb="disabled"), active=True)  # a resumed run appends
    again.log({"step": 2, "loss": 2.0})
    again.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # nothing else, no wandb folder
    with pytest.raises(ValueError, match="disabled, online or offline"):
        MetricLogger(str(tmp_path / "x"), LoggingArgs(wandb="cloud"), active=True)


def test_metrics_are_strict_json_and_a_resume_drops_the_steps_it_redoes(tmp_path):
    """NaN/inf are written as null (a strict parser reads every line); a logger opened at resume_step
    removes the records after that step, which the resumed run logs again."""
    m = MetricLogger(str(tmp_path), LoggingArgs(), active=True)
    for step, loss in ((1, 2.5), (2, float("nan")), (3, float("inf")), (4, 1.5)):
        m.log({"step": step, "loss": loss, "nested": {"x": float("-inf")}})
    m.close()
    path = tmp_path / "metrics.jsonl"

    def strict(line):
        return json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

    rows = [strict(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"], r["nested"]) for r in rows] == [
        (1, 2.5, {"x": None}), (2, None, {"x": None}), (3, None, {"x": None}), (4, 1.5, {"x": None})]
    with open(path, "a") as f:
        f.write('{"step": 5, "lo')  # and a line cut short by the kill
    again = MetricLogger(str(tmp_path), LoggingArgs(), active=True, resume_step=2)
    again.log({"step": 3, "loss": 2.0})
    again.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 2.5), (2, None), (3, 2.0)]


def test_wandb_offline_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    real_connect = socket.socket.connect
    attempts = []

    def no_network(self, address):  # local sockets (wandb's own service) are fine; the internet is not
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(address, tuple) and host not in ("127.0.0.1", "localhost", "::1"):
            attempts.append(address)
            raise OSError(f"network disabled in this test: {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", no_network)
    m = MetricLogger(str(tmp_path), LoggingArgs(wandb="offline", wandb_project="t"), active=True,
                     run_name="offline-test", config={"a": 1})
    for step in (1, 2):
        m.log({"step": step, "loss": 3.0 / step})
    m.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb")), os.listdir(tmp_path)
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [3.0, 1.5]
    assert not attempts, attempts


def test_plot_metrics(tmp_path):
    rows = [{"step": s, "loss": 5.0 / s, "tok_per_s_per_gpu": 1000.0 + s} for s in range(1, 11)]
    rows += [{"step": 5, "val_loss": 1.2, "val_ppl": 3.3}, {"step": 10, "val_loss": 0.9, "val_ppl": 2.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_metrics.main([f"dump_dir={tmp_path}"])
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_step_timer_averages_steps_and_leaves_paused_time_out():
    import time as _time

    import torch

    from lingua_zeco.metrics import StepTimer

    t = StepTimer(torch.device("cpu"))
    for _ in range(2):
        _time.sleep(0.05)  # a step
        t.step()
        t.pause()
        _time.sleep(0.2)  # logging / checkpoint: not step time
        t.resume()
    dt = t.window()
    assert t.last_n == 2 and 0.045 < dt < 0.12, dt
    _time.sleep(0.03)
    t.step()
    assert t.last_n == 2 and 0.025 < t.window() < 0.2 and t.last_n == 1  # a fresh window


def test_duration_text_past_a_day_and_for_any_number_of_steps():
    from lingua_zeco.metrics import duration_text

    assert duration_text(3725.9) == "01:02:05"
    assert duration_text(30 * 3600) == "1d 06:00:00"  # %H of time.gmtime would say 06:00:00
    assert duration_text(0.5 * 1e20) == "never"  # steps=1e20: time.gmtime overflows
    assert duration_text(float("nan")) == "?" and duration_text(-3) == "00:00:00"
