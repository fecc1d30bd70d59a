#!/usr/bin/env bash
# Issue 41's GPU confirmations on one H200 (one device call, < 3 minutes), from the repository root with the
# wheels carried in .whl/:
#     bash setup/gpu/issue41.sh A   # meta-device init on CUDA: the same weights as the default path (1 rank: the
#                                   # 2-rank case needs 2 GPUs) and the same losses; the memory snapshot's CUDA path
# Everything lands in $OUT (the device tool's folder; default /tmp/out), key lines also on stdout.
set -u
PART=${1:?"usage: issue41.sh A"}
source "$(dirname "$0")/device_env.sh"  # wheels, autotune cache, OUT
case "$PART" in
A)
    echo "== meta init on CUDA"; timeout 240 python3 -m pytest -p no:cacheprovider -rfEs --tb=short -q \
        tests/test_meta_init.py -k "one_rank or trains" 2>&1 | tee "$OUT/pytest_meta_init_cuda.txt" | tail -6
    echo "== memory snapshot"; D=$(mktemp -d)
    timeout 200 python3 -m apps.gla.train config=debug.yaml steps=6 dump_dir="$D" profiling.memory_snapshot=true \
        profiling.start_step=2 profiling.warmup=1 profiling.active=2 checkpoint.dump.every=0 2>&1 | tail -3
    python3 -c "import pickle, sys, glob; fs = glob.glob('$D/profile/memory_snapshot_rank0_step*.pickle'); \
s = pickle.load(open(fs[0], 'rb')); print('snapshot', fs[0], 'segments', len(s['segments']), \
'traces', sum(len(t) for t in s['device_traces']))" 2>&1 | tee "$OUT/memory_snapshot_check.txt"
    ;;
esac
(cd /tmp/tc && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
