#!/usr/bin/env bash
# Fill .whl/vllm/part1, part2, ... (git-ignored) with vLLM 0.26.0 and what an offline
# LLM(...) imports that the GPU hosts lack, for hosts with no network (CPython 3.12,
# torch 2.11.0+cu130, which vLLM 0.20-0.26 pin). Each part is one device call's load:
# scripts/vllm_host.sh copies it aside there and, with the last part, installs the lot.
#
# vLLM's wheel is 290 MiB; trimmed here to about 100 MiB by dropping what a dense model
# served with attention_backend="TRITON_ATTN" never loads:
#   _vllm_fa2_C               FlashAttention 2 (124 MiB). FlashAttention 3 (_vllm_fa3_C, 37 MiB)
#                             stays: without both, vllm.vllm_flash_attn raises ImportError, and
#                             every model imports it (layers.attention -> mm_encoder_attention
#                             -> fa_utils); it is loaded, never run, under TRITON_ATTN
#   _moe_C_stable_libtorch    MoE ops (imported under suppress(ImportError))
#   vllm-rs                   the Rust frontend binary (VLLM_RUST_FRONTEND_PATH only)
#   third_party headers       DeepGEMM's and Blackwell FMHA's CUDA headers (their JIT), and
#                             DeepGEMM's _C for other Pythons than 3.12
# _C_stable_libtorch (every _C op, the custom all-reduce too) and the Python files stay.
# RECORD loses the dropped files' lines, so pip's hash check passes.
#
# A part is a folder of whole files, at most PART_MIB (default 45) MiB: the working tree
# that travels with a call is at most 64 MiB, the repo's own files about 15. The trimmed
# vLLM wheel is larger than a part, so it travels as byte chunks NAME.000, NAME.001, ...
# (split(1)), joined again on the host; MANIFEST (in every part) lists each file, its
# part and SHA-256, and the joined wheel's.
# Usage: bash scripts/vllm_wheels.sh   (downloads are cached in .whl/vllm/dl)
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MIB=${PART_MIB:-45}
OUTDIR=.whl/vllm
DL=$OUTDIR/dl
# Pinned: the newest release before vLLM 0.26.0 (2026-07-25) within vLLM's bounds, the
# pydantic set the same as scripts/framework_wheels.sh's (one version of each in /tmp/site).
# The hosts already have torch, triton, transformers, tokenizers, safetensors, numpy, httpx,
# anyio, aiohttp, requests, tqdm, regex, psutil, prometheus-client, pillow, pyyaml,
# cloudpickle, einops, jinja2, annotated-doc, typing-extensions and the rest of vLLM's
# import-time needs (the hosts' package list). llguidance and xgrammar: vllm.v1.structured_output
# annotates classes with their types, evaluated at import on Python 3.12. xgrammar 0.2.6 is
# 1.2 MB, 0.2.1-0.2.5 are 44 MB (a static library inside); vLLM allows 0.2.1 to < 1.0.
# llguidance 1.7 is built for glibc 2.31 and later (manylinux_2_31).
DEPS=(
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  openai==2.48.0 jiter==0.16.0 distro==1.9.0 sniffio==1.3.1 openai-harmony==0.0.8
  fastapi==0.136.3 starlette==1.3.1
  pyzmq==27.1.0 msgspec==0.21.1 cbor2==6.1.3 cachetools==7.1.6 partial-json-parser==0.2.1.1.post7
  pybase64==1.4.3 setproctitle==1.3.7 blake3==1.0.9
  llguidance==1.7.6 xgrammar==0.2.6 apache-tvm-ffi==0.1.10
)
VLLM=vllm==0.26.0
mkdir -p "$DL"
python3 -m pip download -q --no-deps --only-binary=:all: --dest "$DL" \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  "$VLLM" "${DEPS[@]}"
rm -rf "$OUTDIR"/part* "$OUTDIR/stage"
mkdir -p "$OUTDIR/stage"

python3 - "$DL" "$OUTDIR" "$PART_MIB" "$VLLM" "${DEPS[@]}" <<'EOF'
import base64, csv, fnmatch, hashlib, io, os, re, shutil, sys, zipfile

dl, outdir, part_mib, *pins = sys.argv[1:]
stage = os.path.join(outdir, "stage")
part_bytes = int(float(part_mib) * 2**20)


def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_for(pin):  # the downloaded wheel of NAME==VERSION (dl/ may hold other versions)
    name, version = pin.split("==")
    hits = [f for f in os.listdir(dl) if f.endswith(".whl")
            and norm(f.split("-")[0]) == norm(name) and f.split("-")[1] == version]
    if len(hits) != 1:
        sys.exit(f"{pin}: expected one wheel in {dl}, found {hits}")
    return os.path.join(dl, hits[0])


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


DROP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm/include/*",
    "vllm/third_party/fmha_sm100/cutlass/*",
    "vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so",  # other Pythons than 3.12
]
KEEP = [  # must survive DROP
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/third_party/*.py",
]


def trim(src, dst):
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        dropped = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in DROP)}
        for p in KEEP:
            assert not any(fnmatch.fnmatchcase(n, p) for n in dropped), p
        assert all(p in names for p in KEEP[:2])
        for p in DROP[:3]:
            assert p in dropped, f"{p} not in the wheel: check the list against this vLLM"
        rows = list(csv.reader(io.StringIO(zin.read(record).decode())))  # (paths may hold commas)
        kept = [row for row in rows if row[0] not in dropped]
        assert len(rows) - len(kept) == len(dropped)
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
            for info in zin.infolist():
                if info.filename in dropped or info.filename == record:
                    continue
                with zin.open(info) as fin, zout.open(info, "w") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
            text = io.StringIO()
            csv.writer(text, lineterminator="\n").writerows(kept)
            zout.writestr(record, text.getvalue())
        mib = sum(zin.getinfo(n).compress_size for n in dropped) / 2**20
        print(f"trimmed {os.path.basename(src)}: dropped {len(dropped)} files ({mib:.1f} MiB)")


files = []  # (name, path) of each wheel to carry
vllm = wheel_for(pins[0])
trimmed = os.path.join(stage, os.path.basename(vllm))
trim(vllm, trimmed)
with zipfile.ZipFile(trimmed) as z:  # what pip checks: every file hashed as RECORD says
    record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    listed = {row[0]: row[1] for row in csv.reader(io.StringIO(z.read(record).decode()))}
    for n in z.namelist():
        if n == record:
            continue
        want = listed.pop(n)
        got = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(z.read(n)).digest()).rstrip(b"=").decode()
        assert want == got, n
    assert set(listed) == {record}, sorted(listed)[:5]
files.append(trimmed)
for pin in pins[1:]:
    dst = os.path.join(stage, os.path.basename(wheel_for(pin)))
    shutil.copyfile(wheel_for(pin), dst)
    files.append(dst)

# Pieces: whole files, or byte chunks of a file larger than a part.
pieces, joined = [], []
for path in files:
    size = os.path.getsize(path)
    if size <= part_bytes:
        pieces.append((path, size))
        continue
    with open(path, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            chunk = f"{path}.{i:03d}"
            with open(chunk, "wb") as g:
                g.write(block)
            pieces.append((chunk, len(block)))
    joined.append(path)
# First fit, largest first; each part a folder.
parts = []
for path, size in sorted(pieces, key=lambda p: -p[1]):
    for part in parts:
        if part["bytes"] + size <= part_bytes:
            break
    else:
        part = {"bytes": 0, "files": []}
        parts.append(part)
    part["bytes"] += size
    part["files"].append(path)
manifest = ["# part name sha256 bytes ('=': a wheel joined from its chunks NAME.000, ...)"]
for k, part in enumerate(parts, 1):
    d = os.path.join(outdir, f"part{k}")
    os.makedirs(d)
    for path in part["files"]:
        dst = os.path.join(d, os.path.basename(path))
        os.replace(path, dst)
        manifest.append(f"{k} {os.path.basename(path)} {sha256(dst)} {os.path.getsize(dst)}")
for path in joined:
    manifest.append(f"= {os.path.basename(path)} {sha256(path)} {os.path.getsize(path)}")
manifest.append(f"parts {len(parts)}")
for k in range(1, len(parts) + 1):
    with open(os.path.join(outdir, f"part{k}", "MANIFEST"), "w") as f:
        f.write("\n".join(manifest) + "\n")
shutil.rmtree(stage)
EOF

tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "parts (MiB; the working tree that travels beside each: $((tree / 1048576)) MiB, limit 64):"
for d in "$OUTDIR"/part*; do
  printf '  %s  %5.1f MiB\n' "$d" "$(du -cb "$d"/* | tail -1 | cut -f1 | awk '{print $1 / 1048576}')"
  ls "$d" | grep -v MANIFEST | sed 's/^/      /'
done
