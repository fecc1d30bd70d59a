#!/usr/bin/env bash
# GPU check after the issue-21 consolidation: the GPU tests and the refactored one-GPU benches.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
mkdir -p /tmp/tc && tar xzf setup/gpu/triton_autotune_h200.tgz -C /tmp/tc; for f in .tc/*.tgz; do tar xzf "$f" -C /tmp/tc; done
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PT="python3 -m pytest -m gpu -v -p no:cacheprovider -p no:logging -rfEs --tb=short"
echo "== gpu tests"
timeout 130 $PT tests/test_generate.py tests/test_export_hf.py -k gpu > "$OUT/pytest_gen_export.log" 2>&1
timeout 200 $PT tests/test_gpu_sp.py tests/test_gpu_fusions.py tests/test_gpu_checkpoint.py tests/test_symm_scan.py > "$OUT/pytest_gpu.log" 2>&1
grep -hE "PASSED|FAILED|ERROR|passed|failed|Timeout|^E " "$OUT"/pytest_*.log | cut -c1-300 | head -60
echo "== bench_fused"
timeout 100 python3 -m apps.gla.bench.bench_fused out="$OUT" t_local=[16384] warmup=5 iters=20 > "$OUT/bench_fused.log" 2>&1; tail -4 "$OUT/bench_fused.log" | cut -c1-600
echo "== bench_stages"
timeout 60 python3 -m apps.gla.bench.bench_stages out="$OUT" t_local=[16384] iters=20 per_config=false > "$OUT/bench_stages.log" 2>&1; tail -3 "$OUT/bench_stages.log" | cut -c1-400
echo "== profile_fused"
timeout 60 python3 -m apps.gla.bench.profile_fused out="$OUT/profile_fused" > "$OUT/profile_fused.log" 2>&1; tail -3 "$OUT/profile_fused.log" | cut -c1-300
echo "== bench_comm loopback"
timeout 60 python3 -m apps.gla.bench.bench_comm out="$OUT/loopback" loopback=4 methods=[chain] p2p_sizes=[] heads=[16] blocks=[1] warmup=10 iters=50 > "$OUT/bench_comm.log" 2>&1; grep -E "^\||rror" "$OUT/bench_comm.log" | head -8
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
