#!/usr/bin/env bash
# The test suite: installs everything, then runs pytest (GPU tests are skipped
# where there are no GPUs; on a GPU host they run too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "${PYTHON:-python3}" -m pytest "$@"
