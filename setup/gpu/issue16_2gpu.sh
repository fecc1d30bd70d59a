#!/usr/bin/env bash
# The 2-GPU runs of issue 16 in two device calls of < 10 minutes each (nvidia-h200-x2), from the
# repository root, with the wheels carried in .whl/ (see docs/results/gpu_tests.md):
#     bash setup/gpu/issue16_2gpu.sh A     # GPU tests, All-Scan per transport, operator, overlap trace
#     bash setup/gpu/issue16_2gpu.sh B     # training throughput (Tables 5-6 at N = 2), 16K and 32K per GPU
# Everything lands in $OUT (the device tool's folder; default /tmp/out), tables also on stdout.
set -u
PART=${1:?"usage: issue16_2gpu.sh A|B"}
source "$(dirname "$0")/device_env.sh"  # wheels, autotune cache, OUT
T2="torchrun --standalone --nproc_per_node=2"

case "$PART" in
A)
    echo "== GPU tests"; timeout 150 python3 -m pytest -m gpu -v -p no:cacheprovider -rs \
        tests/test_symm_scan.py tests/test_gpu_dist.py 2>&1 | tail -25 | tee "$OUT/pytest_gpu_2gpu.log"
    echo "== bench_comm"; timeout 100 $T2 -m apps.gla.bench.bench_comm out="$OUT" transports=[nccl,symm] \
        p2p_sizes=[4096,65536,1048576,16777216] 2>&1 | grep -E "^\||fit|rror" | tee "$OUT/bench_comm_stdout.md"
    echo "== bench_op"; timeout 220 $T2 -m apps.gla.bench.bench_op out="$OUT" t_local=[16384,32768] warmup=12 iters=20 \
        methods=[none,zeco,zeco_overlap,zeco_blocking,zeco_symm,zeco_symm_blocking,lasp1,lasp2,fla] 2>&1 \
        | grep -E "^\||rror" | tee "$OUT/bench_op_stdout.md"
    echo "== profile_sp"; timeout 90 $T2 -m apps.gla.bench.profile_sp out="$OUT" 2>&1 | tail -20 | tee "$OUT/profile_sp_stdout.txt"
    ;;
B)
    for T in 16384 32768; do
        echo "== bench_train T=$T"; timeout 285 $T2 -m apps.gla.bench.bench_train out="$OUT" stem="train_2gpu_$T" \
            seq_len=$T warmup=2 steps=6 variants=[ours,sp_zeco,sp_zeco_blocking,sp_zeco_symm,sp_lasp1,sp_lasp2,sp_zeco_packed] 2>&1 \
            | grep -E "^\||rror" | tee "$OUT/train_2gpu_${T}_stdout.md"
    done
    ;;
*) echo "error: part must be A or B, got $PART"; exit 2 ;;
esac
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
