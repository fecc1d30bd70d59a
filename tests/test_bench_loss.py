"""bench_loss on CPU: two variants trained in their own processes, their curves compared and drawn; a variant
run later against an earlier output (ref=) gives the rows one run of both would, and so do two outputs run on
their own and compared afterwards (variants= empty: nothing trained)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# float8 needs linears of at least 64 on each side: the MLP's are converted (emulated on CPU)
BASE = ["config=debug.yaml", "steps=4", "tail=2", "seq_len=32",
        "overrides=[model.dim=64,model.n_layers=1,model.n_heads=2,model.ffn_hidden=128,data.batch_size=1]"]


def _bench(out, *argv) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "apps.gla.bench.bench_loss", *BASE, f"out={out}", *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stem = next(a.split("=", 1)[1] for a in argv if a.startswith("stem="))
    assert os.path.getsize(os.path.join(out, stem + ".png")) > 1000  # the curves, drawn
    with open(os.path.join(out, stem + ".json")) as f:
        return json.load(f)


def test_later_variants_and_outputs_run_alone_are_compared_with_earlier_outputs(tmp_path):
    first = _bench(tmp_path, "variants=bf16", "stem=bf16")
    later = _bench(tmp_path, "variants=float8", f"ref={tmp_path / 'bf16.json'}", "stem=float8")
    assert list(later["curves"]) == ["bf16", "float8"] and later["curves"]["bf16"] == first["curves"]["bf16"]
    # every step's record stays in out/ (what a run stopped by a time limit leaves)
    logged = [json.loads(line) for line in (tmp_path / "float8_float8.metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged if "loss" in r] == later["curves"]["float8"]
    bf16, float8 = later["rows"]
    assert bf16 == first["rows"][0] and bf16["tail_vs_ref"] == 0
    curve = later["curves"]["float8"]
    assert len(curve) == 4 and curve != first["curves"]["bf16"]  # float8's rounding moves the loss
    assert float8["tail_mean"] == sum(curve[-2:]) / 2
    assert float8["tail_vs_ref"] == float8["tail_mean"] / bf16["tail_mean"] - 1
    assert abs(float8["tail_vs_ref"]) < 0.02  # and not far

    # the same variant run alone, then both outputs compared without training: the rows and curves of `later`
    alone = _bench(tmp_path, "variants=float8", "stem=float8_alone")
    assert alone["curves"]["float8"] == curve  # the same seed and data: the same curve
    both = _bench(tmp_path, "variants=", f"ref={tmp_path / 'bf16.json'},{tmp_path / 'float8_alone.json'}",
                  "stem=both")
    assert both["rows"] == later["rows"] and both["curves"] == later["curves"]
