#!/usr/bin/env bash
# Issue 19, sixth session: our forward intra-chunk stage and the state scans on a side stream
# (lingua_zeco.kernels.GLAStages), measured on one H200 in device calls of < 10 minutes each, from the
# repository root with the wheels carried in .whl/ (see docs/results/gpu_tests.md):
#     bash setup/gpu/issue19_stages.sh A   # GPU tests of the stages, bench_stages, bench_fused
#     bash setup/gpu/issue19_stages.sh B   # the GLA-1B step, 16K and 32K, every choice of stages
#     bash setup/gpu/issue19_stages.sh C   # 50 GLA-1B steps with the default stages (the loss curve)
# Predictions (written before the first run): forward A 0.37 -> 0.15-0.20 ms a layer at 16K (fla's two
# kernels walk the diagonal block token by token), the step -3 to -4 ms; the side stream: h (fwd) and
# h + dh (bwd), a few dozen programs each, under the intra stages: -5 to -10 ms a step at 16K.
# Everything lands in $OUT (default /tmp/out), tables also on stdout.
set -u
PART=${1:?"usage: issue19_stages.sh A|B|C"}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: carry the fla-core, flash-linear-attention, omegaconf and antlr4 wheels in .whl/ (pip download --no-deps)"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
mkdir -p /tmp/tc && tar xzf setup/gpu/triton_autotune_h200.tgz -C /tmp/tc
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

case "$PART" in
A)
    echo "== GPU tests"; timeout 330 python3 -m pytest -m gpu tests/test_gpu_intra.py tests/test_gpu_sp.py -k "not (packed_documents and fp32)" -p no:logging -rfEs \
        --tb=short -q > "$OUT/pytest_intra.txt" 2>&1; tail -25 "$OUT/pytest_intra.txt"
    echo "== bench_stages"; timeout 120 python3 -m apps.gla.bench.bench_stages out="$OUT" per_config=false 2>&1 | tail -8
    echo "== bench_fused"; timeout 150 python3 -m apps.gla.bench.bench_fused out="$OUT" doc_len=0 iters=40 2>&1 | tail -12
    ;;
B)
    echo "== bench_train 16K"; timeout 300 python3 -m apps.gla.bench.bench_train out="$OUT" stem=train_16k_stages \
        seq_len=16384 steps=12 profile=ours variants=fla,ours,ours_fla_fwd_intra,ours_side_stream,ours_fla_intra 2>&1 | grep -E "^\||rror"
    echo "== bench_train 32K"; timeout 250 python3 -m apps.gla.bench.bench_train out="$OUT" stem=train_32k_stages \
        seq_len=32768 steps=8 variants=ours,ours_fla_fwd_intra,ours_side_stream 2>&1 | grep -E "^\||rror"
    ;;
C)
    shift
    timeout 150 python3 -m apps.gla.train dump_dir=/tmp/runs/c logging.freq=1 config=gla_1b_dp.yaml steps=50 \
        optim.warmup=10 "$@" 2>&1 | tail -3
    cp /tmp/runs/c/metrics.jsonl "$OUT/gla1b_stages.metrics.jsonl"
    ;;
*) echo "error: part must be A, B or C, got $PART"; exit 2 ;;
esac
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
