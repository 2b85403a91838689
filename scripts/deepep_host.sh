#!/usr/bin/env bash
# DeepEP on a GPU host (no network), for the moe benchmark's deepep baselines.
# Usage: bash scripts/deepep_host.sh   (carry .whl/deepep)
#   A wheel in .whl/deepep/ (one brought back by an earlier build) is installed into /tmp/site.
#   Else the source that scripts/deepep_source.sh packed there is built with the host's nvcc,
#   twice at once: with the NVSHMEM that the host's torch brought (nvidia.nvshmem: internode
#   and low-latency kernels too) and without it (intranode kernels only); the first that
#   imports is installed, and its wheel lands in $OUT (in parts of 15 MB: join them with cat
#   into .whl/deepep/ to carry it next time), with the builds' logs (written to $WORK while
#   they run, so that a script that packs $OUT meanwhile does not take them).
# Then: export PYTHONPATH=/tmp/site before python3 -m bench --op moe.
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${DEEPEP_SITE:-/tmp/site} WORK=${DEEPEP_WORK:-/tmp/deepep} OUT=${OUT:-/tmp/overlap_out}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$SITE" "$WORK" "$OUT"
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$1"; }
imports() { PYTHONPATH=$SITE python3 -c "import deep_ep, deep_ep_cpp; print('deep_ep', deep_ep.__file__)"; }
if compgen -G ".whl/deepep/deep_ep-*.whl" >/dev/null; then
  install .whl/deepep/deep_ep-*.whl && imports
  exit
fi
tarball=$(ls .whl/deepep/DeepEP-*.tar.gz 2>/dev/null | head -1)
[ -n "$tarball" ] || { echo "no DeepEP wheel or source in .whl/deepep: run scripts/deepep_source.sh here and carry .whl/deepep" >&2; exit 1; }
build() {  # build NAME SED_SCRIPT TEXT: setup.py edited by SED_SCRIPT must then hold TEXT
  local dir=$WORK/$1
  rm -rf "$dir" && mkdir -p "$dir" && tar -xzf "$tarball" -C "$dir" --strip-components=1
  sed -i "$2" "$dir/setup.py"
  if ! grep -qF "$3" "$dir/setup.py"; then
    echo "deepep build $1: setup.py of $tarball is not the one this script edits (no '$3')" >&2
    return 1
  fi
  (cd "$dir" && env -u NVSHMEM_DIR TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${DEEPEP_JOBS:-12} \
     python3 -m pip wheel --no-deps --no-build-isolation --no-index -w "$dir/dist" . > "$WORK/build_$1.log" 2>&1)
  echo "deepep build $1 rc=$?"
}
python3 -c "import nvidia.nvshmem as n; print('nvidia.nvshmem at', n.__path__[0])" || echo "no nvidia.nvshmem: the NVSHMEM build will fail"
nvcc --version | tail -1
# NVSHMEM's headers include libcu++ (cuda/std/...), which CUDA 13 keeps under include/cccl.
cccl=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}/include/cccl
[ -d "$cccl" ] || echo "no $cccl: the NVSHMEM build will not find cuda/std" >&2
build nvshmem "s|include_dirs = \['csrc/'\]|include_dirs = ['csrc/', '$cccl']|" "$cccl" &
# Without NVSHMEM nothing is device-linked, so relocatable device code would leave its
# registration symbols undefined at import.
build intranode "s/find_spec(\"nvidia.nvshmem\")/find_spec(\"nvidia.nvshmem_not_used\")/; s/'-rdc=true', //" \
  nvshmem_not_used &
wait
for kind in nvshmem intranode; do
  [ ! -f "$WORK/build_$kind.log" ] || tail -c 100000 "$WORK/build_$kind.log" > "$OUT/deepep_build_$kind.log"
done
for kind in nvshmem intranode; do
  wheel=$(ls "$WORK/$kind"/dist/deep_ep-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || continue
  rm -rf "$SITE/deep_ep" "$SITE"/deep_ep_cpp*
  if install "$wheel" && imports; then
    echo "installed the $kind build: $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
    split -b 15M -d "$wheel" "$OUT/$(basename "$wheel").part"
    exit 0
  fi
done
echo "no DeepEP build imports: see $OUT/deepep_build_*.log" >&2
exit 1
