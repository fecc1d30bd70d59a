python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1; mkdir -p /tmp/tc && tar xzf setup/gpu/triton_autotune_h200.tgz -C /tmp/tc
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== pytest"; timeout 240 python3 -m pytest -m gpu -v -p no:cacheprovider -rs tests/test_symm_scan.py 2>&1 | grep -E "PASS|FAIL|SKIP|passed|failed|Error" | tail -16 | tee $OUT/test_symm_scan.log
echo "== loopback P=8"; timeout 90 python3 -m apps.gla.bench.bench_comm out=$OUT/loopback loopback=8 methods=[chain] p2p_sizes=[] heads=[16,32] blocks=[1] warmup=20 iters=100 2>&1 | grep -E "^\| loop|rror" | tail -6
