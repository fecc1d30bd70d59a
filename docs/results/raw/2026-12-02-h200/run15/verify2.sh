#!/usr/bin/env bash
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
mkdir -p /tmp/tc && tar xzf setup/gpu/triton_autotune_h200.tgz -C /tmp/tc; for f in .tc/*.tgz; do tar xzf "$f" -C /tmp/tc; done
date -u
PT="python3 -m pytest -m gpu -v -p no:cacheprovider -p no:logging -rfEs --tb=short"
echo "== export (thread dump after 60 s)"
timeout 100 $PT --timeout=60 "tests/test_export_hf.py::test_export_runs_in_fla_on_gpu[gla]" > "$OUT/pytest_export.log" 2>&1
grep -E "PASSED|FAILED|passed|failed|Timeout|^E |File \"/work|checkpoint|dcp|File .*torch/distributed" "$OUT/pytest_export.log" | cut -c1-250 | head -70
echo "== gpu tests"
timeout 260 $PT tests/test_gpu_sp.py tests/test_gpu_fusions.py tests/test_gpu_checkpoint.py tests/test_symm_scan.py \
    -k "not (packed_documents and fp32)" > "$OUT/pytest_gpu.log" 2>&1
grep -hE "PASSED|FAILED|ERROR|passed|failed|^E " "$OUT/pytest_gpu.log" | cut -c1-200 | head -40
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
