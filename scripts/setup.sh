#!/usr/bin/env bash
# Installs what overlap_kernels needs, from scratch, on either kind of machine.
# - No GPU: torch 2.13.0 (a CPU build), triton 3.6.0, numpy < 2.4 (triton 3.6's
#   interpreter breaks on numpy 2.4), then this package with its test extras and
#   the frameworks whose tests run on the CPU (megatron, transformers).
# - A GPU host: its own torch and triton are used (nothing can be downloaded
#   there); only this package is installed, without touching dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
else
  "$PY" -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4"
  "$PY" -m pip install -q -e ".[test,cpu,megatron,transformers]"
fi
