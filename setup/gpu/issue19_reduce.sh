#!/usr/bin/env bash
# Eighth session's runs on one H200 (issue 19: distributed.reduce_dtype=auto), from the repository root with
# the wheels carried in .whl/ (docs/results/gpu_tests.md); one device call of < 10 minutes per part:
#     bash setup/gpu/issue19_reduce.sh A   # the GPU test of the rule; the 16K step, auto vs fp32 reduction, beside fla
#     bash setup/gpu/issue19_reduce.sh B   # the 32K step; 8 GLA-1B training steps with each reduction (losses)
# Everything lands in $OUT (the device tool's folder; default /tmp/out), key lines also on stdout.
set -u
PART=${1:?"usage: issue19_reduce.sh A|B"}
source "$(dirname "$0")/device_env.sh"  # wheels, autotune cache, OUT
PYTEST="python3 -m pytest -m gpu -p no:logging -p no:cacheprovider -rfEs --tb=short -q"

case "$PART" in
A)
    echo "== GPU test"; timeout 150 $PYTEST tests/test_gpu_fsdp_reduce.py 2>&1 | tee "$OUT/pytest_fsdp_reduce.txt" | tail -6
    echo "== bench_train 16K"; timeout 330 python3 -m apps.gla.bench.bench_train out="$OUT" stem=train_16k_reduce \
        seq_len=16384 steps=12 variants=fla,ours_reduce_fp32,ours,ours_reduce_fp32,ours \
        2>&1 | tee "$OUT/train_16k_reduce.log" | grep -E "^\||rror" | cut -c1-300
    ;;
B)
    echo "== bench_train 32K"; timeout 200 python3 -m apps.gla.bench.bench_train out="$OUT" stem=train_32k_reduce \
        seq_len=32768 steps=8 variants=ours,ours_reduce_fp32,ours 2>&1 | tee "$OUT/train_32k_reduce.log" \
        | grep -E "^\||rror" | cut -c1-300
    for r in auto fp32; do
        echo "== 8 GLA-1B steps, reduce_dtype=$r"
        timeout 120 python3 -m apps.gla.train config=gla_1b_dp.yaml dump_dir=/tmp/runs/$r steps=8 logging.freq=1 \
            checkpoint.dump.every=0 eval.every=0 distributed.reduce_dtype=$r > "$OUT/train_reduce_$r.log" 2>&1
        cp /tmp/runs/$r/metrics.jsonl "$OUT/train_reduce_$r.metrics.jsonl"
        grep -o '"loss": [0-9.e-]*' "$OUT/train_reduce_$r.metrics.jsonl" | tr '\n' ' '; echo
    done
    ;;
*) echo "error: part must be A or B, got $PART"; exit 2 ;;
esac
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
