#!/usr/bin/env bash
# Issue 36's runs on one H200 (compiled blocks, torchao float8), one device call of < 10 minutes per part,
# from the repository root with the wheels carried in .whl/ (fla-core, flash-linear-attention, omegaconf,
# torchao; see docs/results/gpu_tests.md):
#     bash setup/gpu/issue36.sh A   # GPU tests of compile/float8; the 16K step: fla, eager, compiled, float8 + profiles
#     bash setup/gpu/issue36.sh B   # 32K step; the float8 recipes and the head at 16K; packed documents
#     bash setup/gpu/issue36.sh C   # loss parity: GLA-1B 300 steps bf16 vs float8 (run 40 ran a shorter C: cut)
#     bash setup/gpu/issue36.sh D   # the 16K step: fla, compiled bf16, float8 with / without FSDP and head
#     bash setup/gpu/issue36.sh E   # the 16K step: no FSDP, CUDA-graph replay of the blocks, the split GLA operator
# Everything lands in $OUT (the device tool's folder; default /tmp/out), key lines also on stdout.
set -u
PART=${1:?"usage: issue36.sh A|B|C|D|E"}
source "$(dirname "$0")/device_env.sh"  # wheels, autotune cache, OUT
PYTEST="python3 -m pytest -m gpu -p no:logging -p no:cacheprovider -rfEs --tb=short -q"
BENCH="python3 -m apps.gla.bench.bench_train out=$OUT"

case "$PART" in
A)
    echo "== GPU tests"; timeout 240 $PYTEST tests/test_gpu_compile.py tests/test_gpu_fusions.py 2>&1 \
        | tee "$OUT/pytest_gpu_compile.txt" | tail -12
    echo "== bench_train 16K"; timeout 330 $BENCH stem=train_16k seq_len=16384 steps=10 \
        variants=fla,ours_eager,ours,ours_float8 profile=ours,ours_float8 2>&1 | tee "$OUT/train_16k.log" \
        | grep -E "^\{|rror|Traceback"
    ;;
B)
    echo "== GPU tests (float8)"; timeout 100 $PYTEST tests/test_gpu_compile.py -k float8 2>&1 \
        | tee "$OUT/pytest_gpu_float8.txt" | tail -4
    echo "== bench_train 32K"; timeout 250 $BENCH stem=train_32k seq_len=32768 steps=6 \
        variants=fla,ours_eager,ours,ours_float8 2>&1 | tee "$OUT/train_32k.log" | grep -E "^\{|rror|Traceback"
    echo "== bench_train 16K recipes, head, no FSDP, packed"; timeout 230 $BENCH stem=train_16k_more seq_len=16384 \
        steps=6 variants=ours_float8_rowwise,ours_float8_head,ours_nofsdp,ours_float8_nofsdp,ours_packed,ours_packed_eager 2>&1 \
        | tee "$OUT/train_16k_more.log" | grep -E "^\{|rror|Traceback"
    ;;
C)
    echo "== loss parity"; timeout 540 python3 -m apps.gla.bench.bench_loss out="$OUT" stem=loss_float8 \
        config=gla_1b_dp.yaml variants=bf16,float8 steps=300 seq_len=4096 overrides=optim.warmup=30 2>&1 \
        | tee "$OUT/loss_float8.log" | grep -E "^\{|rror|Traceback"
    ;;
D)
    echo "== bench_train 16K"; timeout 240 $BENCH stem=train_16k_d seq_len=16384 steps=6 \
        variants=fla,ours,ours_float8,ours_float8_nofsdp,ours_float8_head_nofsdp 2>&1 | tee "$OUT/train_16k_d.log" \
        | grep -E "^\{|rror|Traceback"
    ;;
E)
    echo "== bench_train 16K"; timeout 540 $BENCH stem=train_16k_e seq_len=16384 steps=6 \
        variants=fla,ours,ours_nofsdp,ours_cudagraphs,ours_cudagraphs_fsdp,ours_split,ours_float8_nofsdp,ours_float8_cudagraphs,ours_float8_split \
        2>&1 | tee "$OUT/train_16k_e.log" | grep -E "^\{|rror|Traceback"
    ;;
esac
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
