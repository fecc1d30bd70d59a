#!/bin/bash
# On the air-gapped cluster: install the pinned requirements from a wheelhouse made by
# setup/download_wheels.sh, never touching an index.
#   bash setup/install_offline.sh wheelhouse [VENV=.venv]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${1:?usage: install_offline.sh WHEELHOUSE [VENV]}"
VENV="${2:-$ROOT/.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -d "$VENV" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
pip install --no-index --find-links "$WHEELS" -r "${REQ:-$ROOT/requirements.txt}"
[ "${CHECK:-1}" = 0 ] || python -c "import torch, fla, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
