#!/usr/bin/env bash
# Issue 39 item 8 on one H200 (one device call of < 10 minutes), from the repository root with the wheels
# carried in .whl/ (see docs/results/gpu_tests.md): the asynchronous checkpoint stalls of GLA-1B (the first
# save's stall with the host buffers prepared once: ≤ 2 s?) and the GPU test that saves reuse those buffers.
#     bash setup/gpu/issue39.sh
set -u
source "$(dirname "$0")/device_env.sh"  # wheels, autotune cache, OUT
echo "== GPU checkpoint tests"; timeout 200 python3 -m pytest -m gpu -p no:logging -p no:cacheprovider -rfEs --tb=short \
    -q tests/test_gpu_checkpoint.py 2>&1 | tee "$OUT/pytest_gpu_checkpoint.txt" | tail -6
echo "== bench_checkpoint"; timeout 360 torchrun --nproc_per_node=1 -m apps.gla.bench.bench_checkpoint out="$OUT" \
    models=gla_1b seq_len=16384 saves=2 modes=async path=/tmp/ckpt 2>&1 | tee "$OUT/bench_checkpoint.log" | tail -20
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
