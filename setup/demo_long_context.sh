#!/usr/bin/env bash
# End-to-end CPU demonstration (docs/long_context.md, section 4): real text -> prepare_data ->
# SentencePiece tokenizer -> GLA trained with SP = 2 (zeco over gloo) on packed documents, async
# checkpoints, in-training validation, a hard kill and a resume from the async checkpoint, then
# apps.gla.eval (loss by position at the training context and at twice it) and the plots.
#
#   bash setup/demo_long_context.sh [RAW_OUT [FIG_OUT]]   # `python`/`torchrun` of the project's env on PATH
#
# Work folder: dumps/demo_long_context (deleted first). RAW_OUT / FIG_OUT (optional): where the raw logs,
# metrics and evaluation lines / the three PNGs are copied. Nothing is downloaded: the text is the docstrings of the Python
# standard library of the interpreter that runs this (one document per module).
set -euo pipefail
cd "$(dirname "$0")/.."
W=dumps/demo_long_context
RAW_OUT=${1:-}
FIG_OUT=${2:-}
export OMP_NUM_THREADS=1  # 2 ranks on 2 cores
rm -rf "$W"
mkdir -p "$W/logs"
T0=$(date +%s)
stamp() { echo "[demo] $(( $(date +%s) - T0 )) s: $*" | tee -a "$W/logs/timings.txt"; }

# 1. Real text: every docstring (module, class, function) of each standard-library module, one .txt per
#    module (tests, idlelib, lib2to3 and site-packages left out; modules with < 200 characters skipped).
python - "$W/text" <<'PY' 2>&1 | tee "$W/logs/extract.log"
import ast, pathlib, platform, sys, sysconfig
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
root = pathlib.Path(sysconfig.get_paths()["stdlib"])
n = chars = 0
for p in sorted(root.rglob("*.py")):
    rel = p.relative_to(root)
    if rel.parts[0] in ("test", "idlelib", "site-packages", "lib2to3") or "tests" in rel.parts:
        continue
    try:
        tree = ast.parse(p.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        continue
    docs = [d for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and (d := ast.get_docstring(node))]
    text = "\n\n".join(docs)
    if len(text) >= 200:
        (out / (str(rel.with_suffix("")).replace("/", ".") + ".txt")).write_text(text, encoding="utf-8")
        n, chars = n + 1, chars + len(text)
print(f"{n} modules, {chars} characters of docstrings from {root} (Python {platform.python_version()})")
PY
stamp "text extracted"

# 2. Shuffled train/valid jsonl shards (5 % of the modules held out), then a 4096-piece BPE tokenizer.
python setup/prepare_data.py input="$W/text" out="$W/prep" txt_doc=file valid_fraction=0.05 shards=4 \
    2>&1 | tee "$W/logs/prepare_data.log"
python setup/train_tokenizer.py data="$W/prep/train" vocab_size=4096 out="$W/tok" threads=2 \
    2>&1 | tee "$W/logs/train_tokenizer.log"
stamp "data prepared, tokenizer trained"

# 3. Training, attempt 1: every rank kills itself (SIGKILL, no chance to save) after step 165, i.e.
#    15 steps after the async checkpoint of step 150 (the trainer's fault hook, lingua_zeco/reliability/faults.py).
set +e
LINGUA_ZECO_FAULT=SIGKILL@165 torchrun --nproc_per_node=2 -m apps.gla.train config=demo_long_context.yaml \
    > "$W/logs/train_attempt1.log" 2>&1
rc=$?
set -e
stamp "attempt 1 ended with exit code $rc (killed on purpose)"
ls "$W/run/checkpoints" | tee "$W/logs/checkpoints_after_kill.txt"

# 4. Attempt 2: the same command resumes from the newest complete checkpoint and runs to step 300.
torchrun --nproc_per_node=2 -m apps.gla.train config=demo_long_context.yaml > "$W/logs/train_attempt2.log" 2>&1
stamp "attempt 2 (resume) done"

# 5. Evaluation of the final checkpoint on the run's SP mesh: the training context (2048 tokens, 12
#    sequences) and twice it (4096 tokens, 6 sequences: the same 24,576 tokens), loss by position.
torchrun --nproc_per_node=2 -m apps.gla.eval dump_dir="$W/run" eval.steps=12 out="$W/run/eval_ctx2048.jsonl" \
    > "$W/logs/eval_ctx2048.log" 2>&1
torchrun --nproc_per_node=2 -m apps.gla.eval dump_dir="$W/run" eval.steps=6 context=4096 \
    out="$W/run/eval_ctx4096.jsonl" > "$W/logs/eval_ctx4096.log" 2>&1
stamp "evaluations done"

# 6. Figures: loss + tokens/s/GPU, loss by position over training, and the two evaluation contexts.
python -m apps.gla.plot_metrics dump_dir="$W/run" out="$W/fig/demo_long_context_metrics.png"
python -m apps.gla.plot_positions dump_dir="$W/run" out="$W/fig/demo_long_context_positions.png"
python -m apps.gla.plot_positions dump_dir="$W/run/eval_ctx2048.jsonl" compare="$W/run/eval_ctx4096.jsonl" \
    out="$W/fig/demo_long_context_eval_context.png"
stamp "figures written"

# 7. Summary of the measured numbers.
python - "$W" <<'PY' | tee "$W/logs/summary.json"
import json, sys
w = sys.argv[1]
rows = [json.loads(l) for l in open(f"{w}/run/metrics.jsonl")]
train = [r for r in rows if "loss" in r]
val = [r for r in rows if "val_loss" in r]
seen, repeated = {}, {}
for r in train:  # a step logged twice: before the kill and again after the resume
    if r["step"] in seen:
        repeated[r["step"]] = [seen[r["step"]], r["loss"]]
    seen[r["step"]] = r["loss"]
last = train[-1]
tps = [r["tok_per_s_per_gpu"] for r in train]
ev = {c: json.loads(open(f"{w}/run/eval_ctx{c}.jsonl").readlines()[-1]) for c in (2048, 4096)}
print(json.dumps({
    "final_step": last["step"], "final_train_loss": last["loss"],
    "val_loss": {r["step"]: r["val_loss"] for r in val},
    "tok_per_s_per_gpu": {"mean": sum(tps) / len(tps), "min": min(tps), "max": max(tps)},
    "train_loss_logged_twice": repeated,
    "eval": {c: {"val_loss": e["val_loss"], "val_tokens": e["val_tokens"], "step": e["step"]} for c, e in ev.items()},
}, indent=1))
PY

stamp "summary written"
if [ -n "$RAW_OUT" ]; then
  mkdir -p "$RAW_OUT"
  cp "$W"/logs/* "$W/run/metrics.jsonl" "$W/run/config.yaml" "$W"/run/eval_ctx*.jsonl "$RAW_OUT/"
  cp "$W/prep/meta.json" "$RAW_OUT/prepare_data_meta.json"
fi
if [ -n "$FIG_OUT" ]; then
  mkdir -p "$FIG_OUT"
  cp "$W"/fig/*.png "$FIG_OUT/"
fi
stamp "total"
[ -z "$RAW_OUT" ] || cp "$W/logs/timings.txt" "$RAW_OUT/"
