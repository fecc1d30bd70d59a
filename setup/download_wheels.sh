#!/bin/bash
# On a machine with internet: download every pinned requirement (and its dependencies) as wheels
# for the cluster's platform, to be copied to an air-gapped cluster and installed with
# setup/install_offline.sh.
#   bash setup/download_wheels.sh [WHEELHOUSE=wheelhouse]
#   PLATFORM=manylinux2014_x86_64 PY_VERSION=3.11 TORCH_CUDA=cu128 bash setup/download_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-wheelhouse}"
PLATFORM="${PLATFORM:-manylinux2014_x86_64}"
PY_VERSION="${PY_VERSION:-3.11}"
mkdir -p "$OUT"
TARGET=(--only-binary=:all: --platform "$PLATFORM" --platform "manylinux_2_28_x86_64" --python-version "$PY_VERSION")
if [ -n "${TORCH_CUDA:-}" ]; then  # the CUDA torch build first; the PyPI one would otherwise win
    pip download "$(grep -E '^torch==' "$ROOT/requirements.txt")" -d "$OUT" "${TARGET[@]}" \
        --index-url "https://download.pytorch.org/whl/$TORCH_CUDA" --extra-index-url https://pypi.org/simple
fi
pip download -r "$ROOT/requirements.txt" -d "$OUT" "${TARGET[@]}"
cp "$ROOT/requirements.txt" "$OUT/"
echo "$(ls "$OUT" | wc -l) files in $OUT; copy it to the cluster and run setup/install_offline.sh $OUT"
