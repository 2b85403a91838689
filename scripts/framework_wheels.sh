#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the framework integrations' wheels for the GPU hosts
# (CPython 3.12, no network there): transformers and megatron-core with what they
# need beyond the hosts' torch, triton and numpy. scripts/gpu_session.sh installs
# .whl/*.whl first; carry .whl to the host with the session (about 31 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --dest .whl \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  transformers==5.23.0 accelerate==1.15.0 megatron-core==0.16.1 \
  huggingface-hub==2.4.0 hf-xet==1.8.0 tokenizers==0.23.3 safetensors==0.8.0 \
  httpx2==2.16.2 httpcore2==2.16.2 anyio==4.16.0 idna==3.20 h11==0.16.0 truststore==0.10.5 \
  click==8.5.1 typer==0.29.2 shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  pygments==2.20.0 annotated-doc==0.0.7 pydantic==2.13.4 pydantic-core==2.46.4 \
  annotated-types==0.7.0 typing-inspection==0.4.2 packaging==26.2 pyyaml==6.0.3 tqdm==4.70.1 \
  regex==2026.5.9 psutil==7.2.2
ls .whl | wc -l
