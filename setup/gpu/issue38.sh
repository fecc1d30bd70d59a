#!/usr/bin/env bash
# Issue 38's runs on one H200 (segment-recurrent training), one device call of < 10 minutes per part, from the
# repository root with the wheels carried in .whl/ (fla-core, flash-linear-attention, omegaconf, torchao):
#     bash setup/gpu/issue38.sh A   # GPU tests of the carried state (new shapes: fla autotunes for minutes)
#     bash setup/gpu/issue38.sh B   # GLA-1B at 1M and 2M tokens per step, segments of 16K
#     bash setup/gpu/issue38.sh C   # GLA-1B at 4M tokens per step; 1M in segments of 32K with selective AC
# Everything lands in $OUT (the device tool's folder; default /tmp/out), key lines also on stdout.
set -u
PART=${1:?"usage: issue38.sh A|B|C"}
source "$(dirname "$0")/device_env.sh"  # wheels, autotune cache, OUT
BENCH="python3 -m apps.gla.bench.bench_train out=$OUT variants=ours warmup=1"
case "$PART" in
A)
    echo "== GPU tests"; LINGUA_ZECO_ONE_CONFIG=1 timeout 540 python3 -m pytest -m gpu -p no:logging -p no:cacheprovider -rfEs --tb=short -q \
        tests/test_gpu_segments.py 2>&1 | tee "$OUT/pytest_gpu_segments.txt" | tail -12
    ;;
B)
    for T in 1048576 2097152; do
        echo "== bench_train $T"; timeout 200 $BENCH stem=seg16k_$T seq_len=$T steps=$((T == 1048576 ? 2 : 1)) \
            overrides=model.segment_len=16384 2>&1 | tee "$OUT/seg16k_$T.log" | grep -E "^\{|rror|Traceback"
    done
    ;;
C)
    echo "== bench_train 4M"; timeout 330 $BENCH stem=seg16k_4194304 seq_len=4194304 steps=1 \
        overrides=model.segment_len=16384 2>&1 | tee "$OUT/seg16k_4194304.log" | grep -E "^\{|rror|Traceback"
    echo "== bench_train 1M, 32K segments, selective AC"; timeout 150 $BENCH stem=seg32k_sel_1048576 seq_len=1048576 \
        steps=1 overrides=model.segment_len=32768,model.activation_checkpointing=selective 2>&1 \
        | tee "$OUT/seg32k_sel_1048576.log" | grep -E "^\{|rror|Traceback"
    ;;
esac
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
