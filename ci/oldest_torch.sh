#!/usr/bin/env bash
# The oldest torch portapipe supports (pyproject.toml: torch>=2.11), in a short leg of .ci/run:
# a fresh virtual environment outside the checkout with pip's default torch of that release
# (for Linux a CUDA build: about 3 GB of wheels, nvidia-* included), then `portapipe verify`, a
# 5-step `train` and the backend, optimizer and FP8 quantizer / matmul tests (2.11 casts past 464
# to NaN: the quantizer's saturation must not rely on the cast), all run from the checkout through
# PYTHONPATH (nothing installed), as on a GPU machine. The environment is removed afterwards.
# Measured on a 2-core machine like CI's: torch 1 min 26 s, the rest 1 min 10 s (nothing
# cached); the whole leg about 10 minutes with other jobs loading the machine.
#
#   bash ci/oldest_torch.sh            # torch 2.11.0
#   OLDEST_TORCH=2.12.0 bash ci/oldest_torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
release="${OLDEST_TORCH:-2.11.0}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
python3 -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
"$py" -m pip install -q "torch==$release"
"$py" -m pip install -q "pyyaml>=6" "pydantic>=2.5" "tqdm>=4.66" "numpy>=1.24" "pytest>=7.4" "hypothesis>=6.90" "scipy>=1.11"
echo "oldest torch: $("$py" -c 'import torch; print(torch.__version__)') installed in $((SECONDS - start)) s"
export PYTHONPATH="$PWD"
"$py" -m portapipe.cli verify examples/cpu.yaml
"$py" -m portapipe.cli train examples/cpu.yaml --steps 5 --set "log.dir=$tmp/run" --set log.progress=false
"$py" -m pytest -q -p no:cacheprovider -m "not cuda and not npu" \
  tests/test_backend_*.py tests/test_registry.py tests/test_optim_*.py tests/test_fp8_quantize.py tests/test_fp8_mm.py
echo "oldest torch: leg done in $((SECONDS - start)) s"
