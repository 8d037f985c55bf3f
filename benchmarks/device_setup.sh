#!/usr/bin/env bash
# Run HERE (not on the GPU machine), from the repository root, before the device calls: fetches what
# the GPU machine lacks for disagg's nodes as Python 3.12 wheels into .whl/ (its image
# has torch, triton, transformers, prometheus-client, tokenizers, and a grpcio older than the
# generated stubs need; not fastapi nor the opentelemetry-api it imports, uvicorn, gguf, llguidance,
# NIXL), and the embedded model's tokenizer into .device/tok. Both are git-ignored; carry [".whl", ".device"] (64 MiB a call).
# NIXL's wheel (57 MB) is slimmed to fit beside the rest: its expert-parallel kernels (nixl_ep, three
# 31 MB builds) and UCX's perftest plugin are dropped, and its RECORD with them.
# benchmarks/handoff_pair_run.sh installs them there.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude || printf '/.whl/\n/.device/\n' >> .git/info/exclude
platforms=()
for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 "${platforms[@]}" --platform any -d "$@"
}
download .whl grpcio==1.85.1 fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection \
    gguf llguidance grpcio-health-checking h11 anyio sniffio click opentelemetry-api importlib-metadata zipp
download /tmp/disagg-nixl nixl-cu13  # the nixl pipe on CUDA 13
rm -rf /tmp/disagg-nixl/x && mkdir /tmp/disagg-nixl/x
(cd /tmp/disagg-nixl/x && unzip -q ../nixl_cu13-*.whl && rm -rf nixl_ep_cu13 nixl_cu13.libs/ucx/libucx_perftest* \
    && sed -i -e '/^nixl_ep_cu13\//d' -e '/libucx_perftest/d' ./*.dist-info/RECORD \
    && rm -f "$OLDPWD"/.whl/nixl_cu13-*.whl && zip -q -r -9 "$OLDPWD/.whl/$(basename ../nixl_cu13-*.whl)" .)
mkdir -p .device/tok
model=$(ls -d "${DISAGG_CACHE:-$HOME/.cache/disagg}"/models/SmolLM2-135M-Instruct-* | head -1)
cp "$model"/tokenizer.json "$model"/tokenizer_config.json .device/tok/
du -sh .whl .device
