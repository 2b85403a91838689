#!/usr/bin/env bash
# Pack DeepEP's V1 source release into .whl/deepep/ (git-ignored) for the GPU hosts, which
# cannot fetch it: scripts/deepep_host.sh builds it there. V1 (v1.2.1) because V2's
# ElasticBuffer needs NCCL >= 2.30.4 and the hosts' torch brings 2.28.
# Usage: bash scripts/deepep_source.sh DEEPEP_GIT_DIR   (a clone of deepseek-ai/DeepEP)
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: deepep_source.sh DEEPEP_GIT_DIR}
tag=${DEEPEP_TAG:-v1.2.1}
mkdir -p .whl/deepep
git -C "$src" archive --format=tar.gz --prefix="DeepEP-${tag#v}/" -o "$PWD/.whl/deepep/DeepEP-${tag#v}.tar.gz" "$tag" \
  csrc deep_ep setup.py LICENSE README.md
ls -l .whl/deepep
