#!/usr/bin/env bash
# Seventh session's runs on one H200 (issues 18/19), one device call of < 10 minutes per part, from the
# repository root with the wheels carried in .whl/ (see docs/results/gpu_tests.md):
#     bash setup/gpu/issue19_packed.sh A   # GPU tests of the intra stage (dense + packed), bench_fused, packed steps
#     bash setup/gpu/issue19_packed.sh B   # the kernel-category profile of the 16K step; the other GPU tests
#     bash setup/gpu/issue19_packed.sh C   # the GPU tests B left (fixed launcher test, fp32 packed, backends,
#                                          # generation, export) and the packed step at 32K
#     bash setup/gpu/issue19_packed.sh D   # the backend tests again, after the fix that C's failure led to
# Everything lands in $OUT (the device tool's folder; default /tmp/out), key lines also on stdout.
set -u
PART=${1:?"usage: issue19_packed.sh A|B|C|D"}
source "$(dirname "$0")/device_env.sh"  # wheels, autotune cache, OUT
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
D)
    echo "== GPU tests"; timeout 200 $PYTEST tests/test_kernels.py tests/test_gpu_intra.py -k "backend or staged" 2>&1 \
        | tee "$OUT/pytest_gpu_backends.txt" | tail -6
    ;;
*) echo "error: part must be A, B, C or D, got $PART"; exit 2 ;;
esac
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
