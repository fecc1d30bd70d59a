#!/usr/bin/env bash
# Issue 37's runs on one H200 (the GLA operator with the All-Scan inside the GPU, lingua_zeco/sp/split.py), one
# device call of < 10 minutes per part, from the repository root with the wheels carried in .whl/:
#     bash setup/gpu/issue37.sh A [K]  # GPU tests: the intra/inter stages, the split operator (fla autotunes new
#                                      # shapes: minutes); K: a pytest -k expression to run part of them
#     bash setup/gpu/issue37.sh B   # bench_stages (intra stages alone), bench_fused 16K/32K: fla, staged, chunk intra,
#                                   # save_h, split2, split auto
#     bash setup/gpu/issue37.sh C   # bench_train GLA-1B 16K in one process: fla, ours (the defaults: whole-chunk
#                                   # stages, kept states), ours_zeco_intra (the defaults before them)
#     bash setup/gpu/issue37.sh D   # bench_fused at 128K
#     bash setup/gpu/issue37.sh E   # the roofline table at 16K and 32K (fla, staged, split_auto)
#     bash setup/gpu/issue37.sh F   # short: the whole-chunk / save_h GPU tests, bench_fused 16K with the fused ZeCO
#                                   # on the same stages, the GLA-1B step with them (≈ 6 min with the autotune union)
#     bash setup/gpu/issue37.sh G   # the pending GPU tests (packed documents, kept states on virtual ranks, fla's
#                                   # test_gla cases), bench_fused 16K/32K without splits (the fused ZeCO target)
#     bash setup/gpu/issue37.sh H   # bench_stages (the output stage's store), the roofline at 16K, bench_fused 128K
#     bash setup/gpu/issue37.sh I   # every GPU test of the operator in 14 processes (pytest-xdist wheel in .whl/:
#                                   # Triton compiles on the CPU, one process at a time); failures' reports land in
#                                   # $OUT/failures_now.txt (run 53 also ran H's roofline and 128K parts after it)
#     bash setup/gpu/issue37.sh J   # the rest of the GPU suite (model, compile, generate, export, checkpoint, SP
#                                   # files) and the dqkg test, 14 processes
#     bash setup/gpu/issue37.sh K   # test_symm_scan alone, one process (its P = 3 loopback failed under J's 14 processes,
#                                   # run 55; again with CUDA_LAUNCH_BLOCKING=1 if it fails), bench_fused 128K
#     bash setup/gpu/issue37.sh L   # the operator's GPU tests (part I's, all of test_gpu_sp and test_gpu_compile) in 14
#                                   # processes, then bench_fused 16K/32K without splits (run 59: dA inside the intra kernel)
#     bash setup/gpu/issue37.sh M   # bench_fused 16K/32K without splits (run 59's was cut while a changed kernel
#                                   # autotuned), then the GLA-1B step as part C
# Everything lands in $OUT (the device tool's folder; default /tmp/out), key lines also on stdout.
set -u
PART=${1:?"usage: issue37.sh A|B|C|D|E|F|G|H|I|J|K|L|M"}
source "$(dirname "$0")/device_env.sh"  # wheels, autotune cache, OUT
case "$PART" in
A)
    echo "== GPU tests"; LINGUA_ZECO_ONE_CONFIG=1 timeout 540 python3 -m pytest -m gpu -p no:logging -p no:cacheprovider -rfEs --tb=short -q \
        tests/test_gpu_intra.py tests/test_gpu_split.py tests/test_gpu_compile.py -k "${2:-intra or split or gla_op}" 2>&1 \
        | tee "$OUT/pytest_gpu_split.txt" | tail -12
    ;;
B)
    echo "== bench_stages 16K"; timeout 200 python3 -m apps.gla.bench.bench_stages out=$OUT t_local=16384 \
        per_config=false 2>&1 | tee "$OUT/bench_stages.log" | grep -E "^\{|rror|Traceback"
    echo "== bench_fused 16K, 32K"; timeout 360 python3 -m apps.gla.bench.bench_fused out=$OUT t_local=16384,32768 \
        splits=2 doc_len=0 iters=40 2>&1 | tee "$OUT/bench_fused.log" | grep -E "^\{|rror|Traceback"
    ;;
C)
    echo "== bench_train 16K"; timeout 540 python3 -m apps.gla.bench.bench_train out=$OUT seq_len=16384 warmup=3 \
        steps=8 variants=fla,ours,ours_zeco_intra 2>&1 | tee "$OUT/bench_train.log" | grep -E "^\{|rror|Traceback" \
        | cut -c1-600
    ;;
D)
    echo "== bench_fused 128K"; timeout 540 python3 -m apps.gla.bench.bench_fused out=$OUT t_local=131072 \
        splits=2,4,8,16 doc_len=0 iters=20 2>&1 | tee "$OUT/bench_fused_128k.log" | grep -E "^\{|rror|Traceback"
    ;;
E)
    echo "== roofline"; timeout 540 python3 -m apps.gla.bench.roofline out=$OUT t_local=16384,32768 2>&1 \
        | tee "$OUT/roofline.log" | grep -E "^\||ceilings|rror|Traceback"
    ;;
F)
    echo "== GPU tests (whole-chunk stages, save_h)"; LINGUA_ZECO_ONE_CONFIG=1 timeout 120 python3 -m pytest -m gpu -p no:logging \
        -p no:cacheprovider -rfEs --tb=short -q tests/test_gpu_intra.py tests/test_gpu_sp.py tests/test_gpu_compile.py \
        -k "fwd_A or dqkg or save_h or gla_op" 2>&1 | tee "$OUT/pytest_gpu_save_h.txt" | tail -8
    echo "== bench_fused 16K"; timeout 110 python3 -m apps.gla.bench.bench_fused out=$OUT t_local=16384 splits=0 \
        doc_len=0 iters=20 2>&1 | tee "$OUT/bench_fused.log" | grep -E "rror|Traceback"
    echo "== bench_train 16K"; timeout 110 python3 -m apps.gla.bench.bench_train out=$OUT stem=train_16k_save_h \
        seq_len=16384 warmup=2 steps=5 variants=ours 2>&1 | tee "$OUT/bench_train.log" \
        | grep -E "^\{|rror|Traceback" | cut -c1-600
    ;;
G)
    echo "== GPU tests (packed, kept states, fla's cases; first autotune config)"; LINGUA_ZECO_ONE_CONFIG=1 timeout 240 \
        python3 -m pytest -m gpu -p no:logging -p no:cacheprovider -rfEs --tb=short -q tests/test_gpu_sp.py \
        tests/test_gpu_intra.py tests/test_gpu_compile.py \
        -k "(packed or dqkg or fwd_A or save_h or gla_op or fla_chunk) and not fused_packed and not packed_state" \
        2>&1 | tee "$OUT/pytest_gpu.txt" | tail -30
    echo "== bench_fused 16K, 32K"; timeout 300 python3 -m apps.gla.bench.bench_fused out=$OUT t_local=16384,32768 \
        splits= doc_len=0 iters=40 2>&1 | tee "$OUT/bench_fused.log" | grep -E "rror|Traceback"
    ;;
H)
    echo "== bench_stages 16K"; timeout 150 python3 -m apps.gla.bench.bench_stages out=$OUT t_local=16384 \
        per_config=false 2>&1 | tee "$OUT/bench_stages.log" | grep -E "rror|Traceback"
    echo "== roofline 16K"; timeout 200 python3 -m apps.gla.bench.roofline out=$OUT t_local=16384 2>&1 \
        | tee "$OUT/roofline.log" | grep -E "ceilings|rror|Traceback"
    echo "== bench_fused 128K"; timeout 190 python3 -m apps.gla.bench.bench_fused out=$OUT t_local=131072 \
        splits= doc_len=0 iters=10 2>&1 | tee "$OUT/bench_fused_128k.log" | grep -E "rror|Traceback"
    ;;
I)
    echo "== GPU tests, 14 processes"; LINGUA_ZECO_ONE_CONFIG=1 timeout 420 python3 -m pytest -n 14 -v -m gpu \
        -p no:logging -p no:cacheprovider -rfEs --tb=short tests/test_gpu_intra.py tests/test_gpu_split.py \
        tests/test_gpu_segments.py tests/test_gpu_sp.py::test_fused_zeco_virtual_ranks_equal_single_device \
        tests/test_gpu_compile.py::test_gla_op_on_fla_stages 2>&1 | tee "$OUT/pytest_gpu_xdist.txt" \
        | grep -E "FAILED|ERROR|passed|failed" | tail -30
    ;;
J)
    echo "== GPU tests, 14 processes"; LINGUA_ZECO_ONE_CONFIG=1 timeout 480 python3 -m pytest -n 14 -v -m gpu \
        -p no:logging -p no:cacheprovider -rfEs --tb=short tests/test_export_hf.py tests/test_generate.py \
        tests/test_gpu_checkpoint.py tests/test_gpu_compile.py tests/test_gpu_dist.py tests/test_gpu_fusions.py \
        tests/test_gpu_sp.py tests/test_kernels.py tests/test_sp_delta.py tests/test_sp_simple_gla.py \
        tests/test_symm_scan.py tests/test_gpu_intra.py::test_dqkg_stored_in_the_gradients_dtypes_rounds_flas_fp32_values \
        2>&1 | tee "$OUT/pytest_gpu_xdist.txt" | grep -E "FAILED|ERROR|passed|failed" | tail -30
    ;;
L)
    echo "== GPU tests, 14 processes"; LINGUA_ZECO_ONE_CONFIG=1 timeout 300 python3 -m pytest -n 14 -v -m gpu \
        -p no:logging -p no:cacheprovider -rfEs --tb=short tests/test_gpu_intra.py tests/test_gpu_split.py \
        tests/test_gpu_segments.py tests/test_gpu_sp.py tests/test_gpu_compile.py 2>&1 \
        | tee "$OUT/pytest_gpu_xdist.txt" | grep -E "FAILED|ERROR|passed|failed" | tail -30
    echo "== bench_fused 16K, 32K"; timeout 240 python3 -m apps.gla.bench.bench_fused out=$OUT t_local=16384,32768 \
        splits= doc_len=0 iters=40 2>&1 | tee "$OUT/bench_fused.log" | grep -E "rror|Traceback"
    ;;
M)
    echo "== bench_fused 16K, 32K"; timeout 320 python3 -m apps.gla.bench.bench_fused out=$OUT t_local=16384,32768 \
        splits= doc_len=0 iters=40 2>&1 | tee "$OUT/bench_fused.log" | grep -E "rror|Traceback"
    echo "== bench_train 16K"; timeout 240 python3 -m apps.gla.bench.bench_train out=$OUT seq_len=16384 warmup=3 steps=8 \
        variants=fla,ours,ours_zeco_intra 2>&1 | tee "$OUT/bench_train.log" | grep -E "rror|Traceback"
    ;;
K)
    echo "== test_symm_scan, one process"; timeout 240 python3 -m pytest -v -m gpu -p no:cacheprovider -rfEs \
        --tb=short tests/test_symm_scan.py 2>&1 | tee "$OUT/pytest_symm.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed"
    if grep -q "FAILED.*on_one_gpu" "$OUT/pytest_symm.txt"; then
        echo "== the failed loopback cases, CUDA_LAUNCH_BLOCKING=1"; CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 -m pytest \
            -v -m gpu -p no:cacheprovider -rfEs --tb=long tests/test_symm_scan.py -k on_one_gpu 2>&1 \
            | tee "$OUT/pytest_symm_blocking.txt" | grep -E "PASSED|FAILED|rror|passed|failed" | head -20
    fi
    echo "== bench_fused 128K (CUDA graphs in one pool)"; timeout 190 python3 -m apps.gla.bench.bench_fused out=$OUT \
        t_local=131072 splits= doc_len=0 iters=10 2>&1 | tee "$OUT/bench_fused_128k.log" | grep -E "rror|Traceback"
    ;;
esac
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
