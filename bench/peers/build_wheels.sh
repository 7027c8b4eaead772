#!/usr/bin/env bash
# Build the wheel folders the peer benchmarks carry to the GPU machine (Python 3.12, x86-64, torch 2.11 +
# CUDA 13, transformers 5.17, no internet), on a machine with pip, network and a local torch (any build: it is
# only imported by setup.py of deepspeed and flash-attn, no extension is compiled).
#   bash bench/peers/build_wheels.sh OUTDIR        -> OUTDIR/verl, OUTDIR/openrlhf (each self-contained)
# Ray 2.60.0 and the vLLM 0.26.0 bundle travel separately (the project's own GPU-run bundles); nothing the image
# already has is in here (its package list: the device notes' "Python packages already there"), nor anything the
# vLLM bundle holds (dill, pyzmq, msgspec, fastapi, uvicorn, cachetools, nvtx, pydantic, ...).
# What is built here from sdists (pure Python): antlr4-python3-runtime, pylatexenc, deepspeed (DS_BUILD_OPS=0:
# no prebuilt ops; its JIT ops are not used by these runs), and flash_attn_pyparts: flash-attn 2.8.3's
# pure-Python modules only (bert_padding, utils/distributed, ops/triton/cross_entropy) under the import name
# flash_attn with version 0.0.1 (so transformers reports flash-attn 2 as unavailable and nothing asks for its
# CUDA kernels); OpenRLHF imports flash_attn.bert_padding at module level, verl uses the Triton cross-entropy
# when present. openrlhf's wheel is pure Python but tagged cp311: it is re-tagged py3-none-any.
set -euo pipefail
out=${1:?usage: build_wheels.sh OUTDIR}
py=${PY:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out/verl" "$out/openrlhf" "$work/bin" "$work/src"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do plat+=(--platform "${p}_x86_64"); done
dl() { "$py" -m pip download -q --no-deps "${plat[@]}" -d "$work/bin" "$@"; }

dl verl==0.9.1 transferqueue==0.1.11 hydra-core==1.3.8 omegaconf==2.3.0 codetiming==1.4.0 torchdata==0.11.0 \
   tensordict==0.10.0 pyvers==0.1.0 importlib-metadata==10.2.0 orjson==3.13.0 datasets==5.2.0 \
   multiprocess==0.70.19 hjson==3.1.0 jsonlines==4.0.0 loralib==0.1.2 optree==0.20.0 ninja==1.13.2
# openrlhf's only wheel is tagged cp311 (its files are pure Python): fetched as it is, re-tagged below
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
   --platform manylinux1_x86_64 -d "$work/bin" openrlhf==0.11.0
"$py" -m pip download -q --no-deps --no-binary=:all: -d "$work/src" antlr4-python3-runtime==4.9.3 pylatexenc==2.11
"$py" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$work/src" deepspeed==0.19.5
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE "$py" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation \
   -d "$work/src" flash-attn==2.8.3
"$py" -m pip wheel -q --no-deps -w "$work/bin" "$work"/src/antlr4*.tar.gz "$work"/src/pylatexenc*.tar.gz
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/bin" "$work"/src/deepspeed*.tar.gz

# openrlhf: pure Python in a cp311-tagged wheel -> the same files as py3-none-any
"$py" - "$work/bin" <<'EOF'
import base64, hashlib, pathlib, sys, zipfile
d = pathlib.Path(sys.argv[1])
src = next(d.glob("openrlhf-*-cp311-*.whl"))
ver = src.name.split("-")[1]
dst = d / f"openrlhf-{ver}-py3-none-any.whl"
rec = []
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
    for info in zi.infolist():
        name = info.filename
        if name.endswith("/RECORD"):
            continue
        data = zi.read(name)
        if f".data/purelib/" in name:
            name = name.split(".data/purelib/", 1)[1]
        if name.endswith(".dist-info/WHEEL"):
            data = b"Wheel-Version: 1.0\nGenerator: relayrl-retag\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        zo.writestr(name, data)
        h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rec.append(f"{name},sha256={h},{len(data)}")
    record = f"openrlhf-{ver}.dist-info/RECORD"
    zo.writestr(record, "\n".join(rec + [f"{record},,"]) + "\n")
src.unlink()
EOF

# flash_attn_pyparts: flash-attn's pure-Python modules, no CUDA kernels (see the header)
mkdir -p "$work/fa" && tar xzf "$work"/src/flash_attn-2.8.3.tar.gz -C "$work/fa"
fa=$(echo "$work"/fa/flash_attn-2.8.3)
pp="$work/pyparts"
mkdir -p "$pp/flash_attn/utils" "$pp/flash_attn/ops/triton"
cp "$fa/flash_attn/bert_padding.py" "$pp/flash_attn/"
cp "$fa/flash_attn/utils/distributed.py" "$pp/flash_attn/utils/"
cp "$fa/flash_attn/ops/triton/cross_entropy.py" "$pp/flash_attn/ops/triton/"
cp "$fa/LICENSE" "$pp/LICENSE"
cat > "$pp/flash_attn/__init__.py" <<'EOF'
"""flash-attn 2.8.3's pure-Python modules (bert_padding, utils.distributed, ops.triton.cross_entropy) without
its CUDA kernels: flash_attn_func & co. are absent, and the version is 0.0.1 so that transformers reports
flash-attn 2 as unavailable. Built by relayrl's bench/peers/build_wheels.sh for the peer benchmarks."""

__version__ = "0.0.1"
EOF
touch "$pp/flash_attn/utils/__init__.py" "$pp/flash_attn/ops/__init__.py" "$pp/flash_attn/ops/triton/__init__.py"
cat > "$pp/pyproject.toml" <<'EOF'
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"
[project]
name = "flash_attn_pyparts"
version = "0.0.1"
description = "flash-attn 2.8.3's pure-Python modules (no CUDA kernels), BSD-3-Clause, for relayrl's peer benchmarks"
license = {text = "BSD-3-Clause"}
[tool.setuptools.packages.find]
include = ["flash_attn*"]
EOF
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/bin" "$pp"

common=(datasets-* multiprocess-* torchdata-* pylatexenc-* flash_attn_pyparts-*)
verl_only=(verl-* transferqueue-* hydra_core-* omegaconf-* antlr4_python3_runtime-* codetiming-* tensordict-*
           pyvers-* importlib_metadata-* orjson-*)
orl_only=(openrlhf-* deepspeed-* hjson-* jsonlines-* loralib-* optree-* ninja-*)  # ninja: FusedAdam JIT build
cd "$work/bin"
for w in "${common[@]}" "${verl_only[@]}"; do cp $w "$out/verl/"; done
for w in "${common[@]}" "${orl_only[@]}"; do cp $w "$out/openrlhf/"; done
du -sh "$out/verl" "$out/openrlhf"
ls -la "$out/verl" "$out/openrlhf"
