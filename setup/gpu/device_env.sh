# Sourced by setup/gpu/run.sh on the device machine, from the repository root: installs the
# carried wheels once (.whl/) into /tmp/site, seeds Triton's autotune cache from the project's union and
# prints the date and the GPU. Leaves OUT (the device tool's folder; default /tmp/out) created.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# once per machine and set of wheels: run.sh calls started side by side do not reinstall under each other
WHEELS_STAMP=/tmp/site/.wheels-$(ls .whl | md5sum | cut -c1-12)
[ -f "$WHEELS_STAMP" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch "$WHEELS_STAMP"; } \
    || { echo "error: carry the fla-core, flash-linear-attention, omegaconf, torchao (and for run.sh tests pytest-xdist,"\
              "execnet) wheels in .whl/ (pip download --no-deps)"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1 LINGUA_ZECO_FAILURES_NOW=1 \
    LINGUA_ZECO_FAILURES_FILE=$OUT/failures_now.txt  # tests/conftest.py
mkdir -p /tmp/tc && tar xzf setup/gpu/triton_autotune_h200.tgz -C /tmp/tc
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
