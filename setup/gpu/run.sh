#!/usr/bin/env bash
# The project's GPU runs on one H200, from the repository root, with the wheels carried in .whl/ (fla-core,
# flash-linear-attention, omegaconf, torchao; pytest-xdist and execnet for `tests`):
#     bash setup/gpu/run.sh PART...
# Parts (minutes on one H200 with the autotune cache seeded by device_env.sh; each fits one device call of 10):
#   tests         every GPU test (pytest -m gpu) in 14 processes, one autotune config per kernel         ≈ 4
#   step          the GLA-1B training step, bench_train fla,ours,ours_float8 at 16K and at 32K tokens,   ≈ 6
#                 and at 16K FSDP forced on the one GPU (ours_fsdp, ours_float8_fsdp) beside the default
#   operator      the GLA operator, bench_fused at 16K and 32K: fla's chunk_gla, ours, fused ZeCO        ≈ 2
#   stages        our kernels beside the fla stages they replace, bench_stages at 16K (dh, dv, dq/dk/dg,    ≈ 3
#                 the forward's A, the ZeCO stages; 2.7 min on an H100 with the autotune cache seeded)
#   long_context  GLA-1B at 4M tokens per step in segments of 16K (docs/long_context.md, section 5)       ≈ 6
#   profile       the 16K step of ours, bf16 and float8, its kernel time by category and the GPU's idle gaps ≈ 2
#   float8_fsdp   the 16K step with FSDP forced on the one GPU, bf16 and float8 (its float8 all-gather),  ≈ 4
#                 each profiled: where float8 under FSDP loses what it gains on the plain module
#   passkey       GLA-1B's passkey evaluation (docs/long_context.md, section 7) at 128K, 1M and 4M tokens   ≈ 4
#                 in segments of 16K: tokens/s and peak memory by length
#   extension     GLA-1B from a Hugging Face folder (docs/long_context.md, section 8): 64K training in       ≈ 5
#                 segments of 16K from an exported folder and from scratch (tok/s side by side); with
#                 passkey in one call (≈ 8) both start from one random GLA-1B run
#   symm          the symmetric-memory All-Scan's loopback under load: what the GPU shares between        ≤ 5
#                 processes (compute mode, MPS, Xid lines), 14 concurrent stress processes, then 12 with 2
#                 processes trapping on purpose beside them
#   memcheck      compute-sanitizer memcheck of 3 stress rounds at P = 2, 3, 5 and of the symm GPU tests   ≈ 4
#   symm_loop     the symm GPU tests 20 times in a row (SYMM_ROUNDS=N for another count), each run in 14   ≈ 7
#                 processes as the suite runs them; one log per run and the count of runs that passed
#   parity_bf16   float8 loss parity, first half: GLA-1B bf16, 1000 steps at 16K tokens (bench_loss)  ≈ 6-9
#                 (8.5 on an H100 of a fresh machine)
#   parity_float8 second half: the same with float8, alone or against the first half's output given as  ≈ 6
#                 PARITY_REF=<parity_bf16.json, carried> (both curves in parity_float8.png); halves run alone are
#                 compared afterwards on any machine: bench_loss <the same keys> variants= ref=<bf16>,<float8>.
#                 Both halves train on the built-in corpus (0.43 MB: memorised within the run), or with
#                 PARITY_DATA=<a folder, carried> on its train/ documents: setup/gpu/parity_corpus.sh makes one
#                 that no run reads twice
#   compare       step (16K) and operator on BASE_DIR, another checkout, and on this tree back to back   ≈ 8
#                 (defaults unchanged or faster across a change); make one with e.g.
#                 mkdir -p dumps/base && git archive <commit> apps lingua_zeco configs | tar -x -C dumps/base
#                 and carry it: BASE_DIR=dumps/base bash setup/gpu/run.sh compare
# Part P writes its raw output under $OUT/P/ ($OUT: the device tool's folder; default /tmp/out), packed into $OUT/P.tgz
# when the part ends (the device tool brings back 8 files a call: at most 7 parts a call, and Triton's autotune results
# in $OUT/autotune.tgz; fold those into setup/gpu/triton_autotune_h200.tgz). Exit code: 0 when every part's commands
# exited 0, else 1 (the last lines say which did not); 2 for bad arguments.
set -u
PARTS="tests step operator stages long_context profile float8_fsdp passkey extension symm memcheck symm_loop parity_bf16 parity_float8 compare"
USAGE="usage: bash setup/gpu/run.sh PART... with PART one of: ${PARTS// /, }"

# ---------------------------------------------------------------------------------------------- arguments
# checked before anything is installed: a typo costs no device time
[ $# -gt 0 ] || { echo "error: no part given; $USAGE"; exit 2; }
[ $# -le 7 ] || { echo "error: $# parts given; the device tool brings back 8 files a call: give at most 7"; exit 2; }
for part in "$@"; do
    case " $PARTS " in
    *" $part "*) ;;
    *) echo "error: unknown part '$part'; $USAGE"; exit 2 ;;
    esac
done
case " $* " in
*" compare "*)
    [ -n "${BASE_DIR:-}" ] && [ -d "${BASE_DIR}/apps/gla/bench" ] \
        || { echo "error: compare needs BASE_DIR=<a checkout of the repository, carried to the device>"; exit 2; }
    BASE_DIR=$(cd "$BASE_DIR" && pwd) ;;
esac
if [ -n "${PARITY_REF:-}" ]; then
    [ -f "$PARITY_REF" ] || { echo "error: PARITY_REF=$PARITY_REF is not a file; carry the parity_bf16.json of parity_bf16 to the device, or leave PARITY_REF out"; exit 2; }
    PARITY_REF=$(cd "$(dirname "$PARITY_REF")" && pwd)/$(basename "$PARITY_REF")
fi

if [ -n "${PARITY_DATA:-}" ]; then
    [ -d "$PARITY_DATA/train" ] || { echo "error: PARITY_DATA=$PARITY_DATA has no train/ folder; make one with bash setup/gpu/parity_corpus.sh and carry it"; exit 2; }
fi

source setup/gpu/device_env.sh  # wheels, autotune cache, OUT, PYTHONPATH=/tmp/site:$PWD
HERE=$PWD
FAILED=()

# run DIR LOG LIMIT_S PATTERN CMD...: CMD in DIR (a checkout; its own code first on PYTHONPATH) under its time
# limit, all output into LOG, the lines matching PATTERN shown; a non-zero exit is kept for the summary
run() {
    local dir=$1 log=$2 limit=$3 pattern=$4
    shift 4
    mkdir -p "$(dirname "$log")"
    echo "== $* (in $dir, limit ${limit} s)"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$limit" "$@") 2>&1 | tee "$log" | grep -E "$pattern" | cut -c1-600
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        FAILED+=("$log: exit $rc$([ "$rc" -eq 124 ] && echo ", cut by its ${limit} s limit")")
    fi
    return "$rc"
}

# bench_train in DIR: DIR OUT_DIR LIMIT_S key=value... (stem= among them names the log)
train() {
    local dir=$1 out=$2 limit=$3 stem
    shift 3
    stem=$(printf '%s\n' "$@" | sed -n 's/^stem=//p')
    run "$dir" "$out/$stem.log" "$limit" "^\{|rror|Traceback" python3 -m apps.gla.bench.bench_train out="$out" "$@"
}

# bench_fused in DIR: DIR OUT_DIR LIMIT_S [key=value...]
operator_bench() {
    local dir=$1 out=$2 limit=$3
    shift 3
    run "$dir" "$out/bench_fused.log" "$limit" "^\{|rror|Traceback" \
        python3 -m apps.gla.bench.bench_fused out="$out" t_local=16384,32768 iters=40 "$@"
}
STEP_16K=(stem=train_16384 seq_len=16384 warmup=3 steps=8)
DEFAULTS=variants=fla,ours,ours_float8  # what every checkout has: compare runs them on both

# ---------------------------------------------------------------------------------------------- parts
part_tests() {
    # one config per autotuner (tests/conftest.py): the tests check values, which any config must get right;
    # failures' reports as they happen (xdist workers' too)
    LINGUA_ZECO_ONE_CONFIG=1 run "$HERE" "$OUT/tests/pytest_gpu.txt" 540 "FAILED|ERROR|passed|failed" \
        python3 -m pytest -m gpu -n 14 -v -p no:logging -p no:cacheprovider -rfEs --tb=short tests/
}

part_step() {
    train "$HERE" "$OUT/step" 330 "${STEP_16K[@]}" "$DEFAULTS",ours_fsdp,ours_float8_fsdp
    train "$HERE" "$OUT/step" 300 stem=train_32768 seq_len=32768 warmup=3 steps=6 "$DEFAULTS"
}

part_operator() {
    operator_bench "$HERE" "$OUT/operator" 480
}

part_stages() {
    run "$HERE" "$OUT/stages/bench_stages.log" 300 "^\{|rror|Traceback" python3 -m apps.gla.bench.bench_stages \
        out="$OUT/stages" t_local=16384 per_config=false
}

part_long_context() {  # three steps of ≈ 96 s: the first (compiles), one warm-up, one timed
    train "$HERE" "$OUT/long_context" 540 stem=seg16k_4194304 variants=ours seq_len=4194304 warmup=1 steps=1 \
        overrides=model.segment_len=16384
}

part_profile() {
    train "$HERE" "$OUT/profile" 540 stem=train_16384_profile seq_len=16384 warmup=3 steps=8 variants=ours,ours_float8 \
        profile=ours,ours_float8
}

part_float8_fsdp() {
    train "$HERE" "$OUT/float8_fsdp" 420 stem=train_16384_fsdp seq_len=16384 warmup=3 steps=8 \
        variants=ours_fsdp,ours_float8_fsdp profile=ours_fsdp,ours_float8_fsdp
}

# a GLA-1B run folder with one step of random weights, /tmp/gla_1b_base.<pid> (the passkey and extension parts measure
# the paths, not a model; made once a call, so both parts in one call share it); not compiled: the step is not
# what is measured. gla_1b_base LOG_DIR (where its log goes)
GLA_1B_BASE=/tmp/gla_1b_base.$$ GLA_1B_BASE_MADE=
gla_1b_base() {
    [ -n "$GLA_1B_BASE_MADE" ] && return
    run "$HERE" "$1/base.log" 240 "rror|Traceback|tok/s" python3 -m apps.gla.train config=gla_1b_zeco.yaml \
        dump_dir="$GLA_1B_BASE" steps=1 data.seq_len=4096 model.compile=none && GLA_1B_BASE_MADE=1
}

part_passkey() {
    local out="$OUT/passkey"
    gla_1b_base "$out"
    run "$HERE" "$out/passkey.log" 300 "rror|Traceback|accuracy|random" python3 -m apps.gla.eval \
        dump_dir=$GLA_1B_BASE task=passkey lengths=128K,1M,4M trials=1 segment=16384 out="$out/passkey.jsonl"
}

part_extension() {
    local tmp=/tmp/extension out="$OUT/extension" long=(data.seq_len=65536 model.segment_len=16384 steps=8
                                                           logging.freq=1)
    gla_1b_base "$out"
    run "$HERE" "$out/export.log" 120 "rror|Traceback" python3 -m apps.gla.export_hf dump_dir=$GLA_1B_BASE \
        out="$out/hf" dtype=bf16
    run "$HERE" "$out/from_hf.log" 200 "rror|Traceback|tok/s|Hugging" python3 -m apps.gla.train \
        config=gla_1b_zeco.yaml dump_dir=$tmp/from_hf checkpoint.init_ckpt_path="$out/hf" "${long[@]}"
    run "$HERE" "$out/scratch.log" 150 "rror|Traceback|tok/s" python3 -m apps.gla.train config=gla_1b_zeco.yaml \
        dump_dir=$tmp/scratch "${long[@]}"
    rm -rf "$out/hf" "$tmp"  # weights of random GLA-1B: not a result
}

# stress N_SCAN N_TRAP LOG_DIR LIMIT_S: N_SCAN `gpu_symm_stress.py scan` processes (P = 2, 3, 5 in turn) and
# N_TRAP trapping ones started 5 s later, at once on the one GPU; one log and one exit code per process, and a
# count of the scan processes that failed
stress() {
    local n_scan=$1 n_trap=$2 dir=$3 limit=$4 i pids=()
    mkdir -p "$dir"
    for ((i = 0; i < n_scan; i++)); do
        (timeout "$limit" python3 tests/gpu_symm_stress.py scan $((i % 3 == 0 ? 2 : i % 3 == 1 ? 3 : 5)) 10 60 \
            >"$dir/scan_$i.log" 2>&1; echo $? >"$dir/scan_$i.rc") &
        pids+=($!)
    done
    sleep 5
    for ((i = 0; i < n_trap; i++)); do
        (timeout 120 python3 tests/gpu_symm_stress.py trap $((i % 2)) 1 >"$dir/trap_$i.log" 2>&1
         echo $? >"$dir/trap_$i.rc") &
        pids+=($!)
    done
    wait "${pids[@]}"
    local bad
    bad=$(grep -Lx 0 "$dir"/scan_*.rc | wc -l)
    echo "== $dir: $bad of $n_scan scan processes failed (with $n_trap trapping beside them)"
    grep -h -m1 -iE "illegal|error" "$dir"/scan_*.log | sort | uniq -c | head -5
    [ "$bad" -eq 0 ] || FAILED+=("$dir: $bad of $n_scan scan processes failed")
}

part_symm() {
    local out="$OUT/symm"
    mkdir -p "$out"
    { nvidia-smi -q -d COMPUTE; pgrep -a nvidia-cuda-mps || echo "no MPS daemon"; } >"$out/gpu_sharing.txt" 2>&1
    grep -iE "compute mode|MPS" "$out/gpu_sharing.txt"
    stress 14 0 "$out/concurrent" 130
    stress 12 2 "$out/with_traps" 130
    dmesg 2>/dev/null | grep -i xid | tail -20 >"$out/xid.txt"
    [ -s "$out/xid.txt" ] && cat "$out/xid.txt"
}

part_memcheck() {
    local out="$OUT/memcheck" sanitizer P
    mkdir -p "$out"
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    if [ -z "$sanitizer" ]; then
        echo "no compute-sanitizer on this machine" | tee "$out/missing.txt"
        FAILED+=("$out: no compute-sanitizer")
    else
        for P in 2 3 5; do
            run "$HERE" "$out/scan_$P.txt" 120 "ERROR SUMMARY|Invalid|rror" "$sanitizer" --tool memcheck \
                --target-processes all --error-exitcode 3 python3 tests/gpu_symm_stress.py scan "$P" 3 60
        done
        # every symm GPU test one GPU runs: the loopback at P = 2, 3, 5 and the dead peer's ends
        run "$HERE" "$out/pytest.txt" 240 "ERROR SUMMARY|passed|failed" "$sanitizer" --tool memcheck \
            --target-processes all --error-exitcode 3 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
            tests/test_symm_scan.py
    fi
}

part_symm_loop() {
    local i rounds=${SYMM_ROUNDS:-20} before=${#FAILED[@]}
    for ((i = 1; i <= rounds; i++)); do
        run "$HERE" "$OUT/symm_loop/run_$i.txt" 120 "passed|failed" python3 -m pytest -m gpu -n 14 -q -p no:cacheprovider \
            tests/test_symm_scan.py tests/test_symm_setup.py tests/test_symm_protocol.py
    done
    echo "== symm_loop: $((rounds - ${#FAILED[@]} + before)) of $rounds runs passed"
}

PARITY=(config=gla_1b_dp.yaml steps=1000 seq_len=16384 tail=100)  # the float8 parity runs: same data and seed
if [ -n "${PARITY_DATA:-}" ]; then  # as given (a path under the checkout): both halves' outputs then name the same
    PARITY+=("overrides=[\"data.root_dir=$PARITY_DATA\",\"data.sources={train: 1.0}\"]")
fi

part_parity_bf16() {
    run "$HERE" "$OUT/parity_bf16/parity_bf16.log" 560 "^\{|rror|Traceback" python3 -m apps.gla.bench.bench_loss \
        "${PARITY[@]}" variants=bf16 stem=parity_bf16 out="$OUT/parity_bf16"
}

part_parity_float8() {
    local ref=()
    [ -z "${PARITY_REF:-}" ] || ref=(ref="$PARITY_REF")
    run "$HERE" "$OUT/parity_float8/parity_float8.log" 560 "^\{|rror|Traceback" python3 -m apps.gla.bench.bench_loss \
        "${PARITY[@]}" variants=float8 "${ref[@]}" stem=parity_float8 out="$OUT/parity_float8"
}

part_compare() {  # base then current for each benchmark: drift over the call hits both alike
    train "$BASE_DIR" "$OUT/compare/base" 160 "${STEP_16K[@]}" "$DEFAULTS"
    train "$HERE" "$OUT/compare/current" 160 "${STEP_16K[@]}" "$DEFAULTS"
    # dense rows only: with the packed ones neither checkout printed a row within 110 s (2026-12-05)
    operator_bench "$BASE_DIR" "$OUT/compare/base" 180 doc_len=0
    operator_bench "$HERE" "$OUT/compare/current" 180 doc_len=0
}

for part in "$@"; do
    echo "==== $part ($(date -u +%H:%M:%S) UTC)"
    start=$SECONDS
    mkdir -p "$OUT/$part"
    export LINGUA_ZECO_FAILURES_FILE="$OUT/$part/failures_now.txt"  # pytest's failures as they happen, with the part
    "part_$part"
    echo "==== $part: $((SECONDS - start)) s"
    [ -d "$OUT/$part" ] && tar czf "$OUT/$part.tgz" -C "$OUT" "$part" && rm -rf "${OUT:?}/$part"
done
(cd "$TRITON_CACHE_DIR" && find . -name '*autotune*.json' | tar czf "$OUT/autotune.tgz" -T -)
rm -rf "$GLA_1B_BASE"
if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'not ok: %s\n' "${FAILED[@]}"
    exit 1
fi
echo "all commands exited 0"
