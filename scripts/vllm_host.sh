#!/usr/bin/env bash
# On a GPU host (no network): carry vLLM's wheels in, one part per device call.
# Usage: bash scripts/vllm_host.sh PART [--install]
#   PART       copies .whl/vllm/partPART (name it in the call's carry) to /tmp/stash/partPART,
#              which outlives the call while the machine stays warm (30 s after a call ends:
#              send the parts back to back)
#   --install  (with the last part) checks every part's files against MANIFEST, joins the
#              split vLLM wheel, installs all wheels into /tmp/site (--no-deps --no-index;
#              the host's torch, triton, transformers stay), and imports vLLM from there
# Afterwards, in the same call or one that follows while the machine is warm:
#   PYTHONPATH=/tmp/site python3 scripts/vllm_engine_check.py
# scripts/vllm_wheels.sh makes the parts (docs/integrations.md, "vLLM on the GPU hosts").
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: vllm_host.sh PART [--install]}
install=${2:-}
STASH=${VLLM_STASH:-/tmp/stash} SITE=${VLLM_SITE:-/tmp/site} PY=${PYTHON:-python3}
src=.whl/vllm/part$part
if [ ! -f "$src/MANIFEST" ]; then
  echo "no $src/MANIFEST here: name .whl/vllm/part$part in this call's carry" >&2
  exit 1
fi
mkdir -p "$STASH/part$part"
cp "$src"/* "$STASH/part$part/"
echo "part $part stashed: $(du -sh "$STASH/part$part" | cut -f1) in $STASH/part$part; stash holds: $(ls "$STASH" | tr '\n' ' ')"
[ "$install" = --install ] || exit 0

manifest=$STASH/part$part/MANIFEST
nparts=$(awk '$1 == "parts" {print $2}' "$manifest")
missing=()
for k in $(seq 1 "$nparts"); do [ -f "$STASH/part$k/MANIFEST" ] || missing+=("$k"); done
if ((${#missing[@]})); then
  echo "parts ${missing[*]} missing from $STASH (the machine went cold between calls?):" \
    "send the parts again, from part 1, back to back" >&2
  exit 1
fi
# Every file of every part, by its SHA-256; then each split wheel joined and checked.
awk '$1 ~ /^[0-9]+$/ {print $3 "  '"$STASH"'/part" $1 "/" $2}' "$manifest" | sha256sum --check --quiet
rm -rf "$STASH/whl"
mkdir -p "$STASH/whl"
while read -r k name _; do
  case $name in *.whl) ln -sf "$STASH/part$k/$name" "$STASH/whl/$name" ;; esac
done < <(awk '$1 ~ /^[0-9]+$/' "$manifest")
while read -r _ name sha _; do
  awk -v n="$name" '$1 ~ /^[0-9]+$/ && index($2, n ".") == 1 {print $2, $1}' "$manifest" | sort \
    | while read -r chunk k; do cat "$STASH/part$k/$chunk"; done > "$STASH/whl/$name"
  echo "$sha  $STASH/whl/$name" | sha256sum --check --quiet
done < <(awk '$1 == "="' "$manifest")
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$STASH"/whl/*.whl
echo "installed $(ls "$STASH"/whl | wc -l) wheels into $SITE; vLLM from there:"
PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "import vllm; print('vllm', vllm.__version__)"
