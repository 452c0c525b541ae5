#!/usr/bin/env bash
# On a CUDA machine: the op-parity harness on the CUDA device, the mixture-of-experts models
# on it (every layer there, and with the experts kept on the CPU: --cpu-moe, --n-cpu-moe,
# -ot), then both real models fully offloaded and split on the torch backend (parity with the CPU backend, prompt and decode
# tok/s), beside llama.cpp's CUDA build when LLAMA_PYTHON names a Python that has one.
#
#   bash scripts/gpu_check.sh                    # needs a CUDA device visible to torch
#   LLAMA_PYTHON=/venv/bin/python bash scripts/gpu_check.sh
#   bash scripts/gpu_check.sh --cpu              # the same checks on torch's CPU build
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

if [ "${1:-}" != "--cpu" ]; then
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else
              "no CUDA device visible to torch (use --cpu to run the checks on the CPU build)")'
    "$PY" -c 'import torch; p = torch.cuda.get_device_properties(0);
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")'
    marker=cuda
else
    marker="not cuda and not metal"
fi
echo "== op parity against the CPU backend ($marker)"
"$PY" -m pytest -q tests/unit/test_backend_ops.py -m "$marker" -k "torch" -p no:cacheprovider
echo "== mixture-of-experts models on the device, and with their experts on the CPU"
"$PY" -m pytest -q -s tests/models/test_moe.py -k "torch and (device_backends or experts_kept)" \
    -p no:cacheprovider
echo "== real models, fully offloaded and split"
"$PY" scripts/gpu_check.py smollm2-135m gemma3-270m --backend torch \
    ${LLAMA_PYTHON:+--llama-python "$LLAMA_PYTHON"}
