#!/usr/bin/env bash
# Seventh session's runs on one H200 (issues 18/19), two device calls of < 10 minutes each, from the
# repository root with the wheels carried in .whl/ (see docs/results/gpu_tests.md):
#     bash setup/gpu/issue19_packed.sh A   # GPU tests of the intra stage (dense + packed), bench_fused, packed steps
#     bash setup/gpu/issue19_packed.sh B   # the kernel-category profile of the 16K step; the other GPU tests
#     bash setup/gpu/issue19_packed.sh C   # the GPU tests B left (fixed launcher test, fp32 packed, backends,
#                                          # generation, export) and the packed step at 32K
# Everything lands in $OUT (the device tool's folder; default /tmp/out), key lines also on stdout.
set -u
PART=${1:?"usage: issue19_packed.sh A|B|C"}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: carry the fla-core, flash-linear-attention, omegaconf and antlr4 wheels in .whl/ (pip download --no-deps)"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1 LINGUA_ZECO_FAILURES_NOW=1  # tests/conftest.py
mkdir -p /tmp/tc && tar xzf setup/gpu/triton_autotune_h200.tgz -C /tmp/tc
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTEST="python3 -m pytest -m gpu -p no:logging -p no:cacheprovider -rfEs --tb=short -q"

case "$PART" in
A)
    echo "== GPU tests of the intra stage"; timeout 200 $PYTEST tests/test_gpu_intra.py 2>&1 | tee "$OUT/pytest_intra.txt" | tail -15
    echo "== bench_fused"; timeout 170 python3 -m apps.gla.bench.bench_fused out="$OUT" doc_len=4096 iters=30 2>&1 \
        | tee "$OUT/bench_fused.log" | grep -E "^\||rror" | cut -c1-400
    echo "== bench_train packed"; timeout 150 python3 -m apps.gla.bench.bench_train out="$OUT" stem=train_16k_packed \
        seq_len=16384 steps=10 variants=ours,ours_packed,ours_packed_fla_intra 2>&1 | tee "$OUT/train_16k_packed.log" \
        | grep -E "^\{|rror"
    ;;
B)
    echo "== bench_train profile"; timeout 330 python3 -m apps.gla.bench.bench_train out="$OUT" stem=train_16k_profile \
        seq_len=16384 steps=10 variants=ours profile=ours 2>&1 | tee "$OUT/train_16k_profile.log" | tail -40
    echo "== the other GPU tests"; timeout 420 $PYTEST tests/test_gpu_intra.py tests/test_gpu_sp.py tests/test_gpu_fusions.py \
        tests/test_gpu_checkpoint.py tests/test_symm_scan.py -k "not (packed_documents and fp32)" 2>&1 \
        | tee "$OUT/pytest_gpu_other.txt" | tail -15
    ;;
C)
    echo "== GPU tests"; timeout 200 $PYTEST tests/test_gpu_sp.py -k "packed_state_launchers or (packed_documents and fp32)" \
        2>&1 | tee "$OUT/pytest_gpu_sp_rest.txt" | tail -6
    timeout 160 $PYTEST tests/test_kernels.py tests/test_generate.py tests/test_export_hf.py 2>&1 \
        | tee "$OUT/pytest_gpu_backends.txt" | tail -6
    echo "== bench_train packed 32K"; timeout 130 python3 -m apps.gla.bench.bench_train out="$OUT" stem=train_32k_packed \
        seq_len=32768 steps=6 variants=ours,ours_packed 2>&1 | tee "$OUT/train_32k_packed.log" | grep -E "^\{|rror"
    ;;
*) echo "error: part must be A, B or C, got $PART"; exit 2 ;;
esac
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
