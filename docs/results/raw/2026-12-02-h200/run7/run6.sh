python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1; mkdir -p /tmp/tc && tar xzf setup/gpu/triton_autotune_h200.tgz -C /tmp/tc
env | grep -E "SYMM|NVLS|NVSHMEM"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch;print(torch.__version__)"
echo "== probe"; timeout 120 python3 .probe/symm_probe.py 2>&1 | grep -v Warning | tail -15
echo "== pytest"; timeout 300 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_symm_scan.py 2>&1 | tail -25 | tee $OUT/test_symm_scan.log
for P in 2 3; do echo "== bench_comm P=$P shared GPU"; timeout 100 torchrun --standalone --nproc_per_node=$P -m apps.gla.bench.bench_comm out=$OUT/comm_shared backend=gloo transports=[symm] methods=[chain,tree] p2p_sizes=[] heads=[16,32] blocks=[1,2,4] warmup=10 iters=100 2>&1 | grep -E "^\||error|Error" | tail -14; done
