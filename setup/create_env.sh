#!/bin/bash
# Build the Python environment with the pinned versions of requirements.txt.
#   bash setup/create_env.sh                  # venv in .venv (python3.11 if present, else python3)
#   ENV_KIND=conda ENV_NAME=zeco bash setup/create_env.sh
#   TORCH_CUDA=cu126 bash setup/create_env.sh # pick the CUDA wheel tag (default: from nvidia-smi)
# With nvidia-smi present, torch comes from the PyTorch CUDA index first; the rest from PyPI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$ROOT/requirements.txt"
ENV_KIND="${ENV_KIND:-venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if [ "$ENV_KIND" = conda ]; then
    ENV_NAME="${ENV_NAME:-lingua-zeco}"
    conda create -y -n "$ENV_NAME" python=3.11
    # shellcheck disable=SC1091
    source "$(conda info --base)/etc/profile.d/conda.sh"
    conda activate "$ENV_NAME"
else
    VENV="${VENV:-$ROOT/.venv}"
    "$PYTHON" -m venv "$VENV"
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
fi
python -m pip install --upgrade pip

TORCH_PIN="$(grep -E '^torch==' "$REQ")"
if command -v nvidia-smi >/dev/null 2>&1; then
    if [ -z "${TORCH_CUDA:-}" ]; then
        CUDA_VER="$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\)\.\([0-9]*\).*/\1\2/p' | head -n 1)"
        # The newest wheel tag the driver can run (drivers run older CUDA runtimes).
        if [ -n "$CUDA_VER" ] && [ "$CUDA_VER" -ge 128 ]; then TORCH_CUDA=cu128
        elif [ -n "$CUDA_VER" ] && [ "$CUDA_VER" -ge 126 ]; then TORCH_CUDA=cu126
        else TORCH_CUDA=cu118; fi
    fi
    echo "GPU found: installing $TORCH_PIN from the PyTorch $TORCH_CUDA index"
    pip install "$TORCH_PIN" --index-url "https://download.pytorch.org/whl/$TORCH_CUDA"
else
    echo "no nvidia-smi: CPU install"
fi
pip install -r "$REQ"
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
PY
echo "done; activate with: source ${VENV:-<conda env $ENV_NAME>}/bin/activate"
