#!/usr/bin/env bash
# Run HERE (not on the GPU machine), from the repository root, before the device calls: fetches what
# the GPU machine lacks for disagg's nodes as Python 3.12 wheels into .whl/ and .whlnx/ (its image
# has torch, triton, transformers, prometheus-client, tokenizers, and a grpcio older than the
# generated stubs need; not fastapi nor the opentelemetry-api it imports, uvicorn, gguf, llguidance,
# NIXL), and the embedded model's tokenizer into .device/tok. All three are git-ignored; carry [".whl", ".device"], or [".whlnx"] alone for the nixl pipe (64 MiB a call).
# benchmarks/handoff_pair_run.sh installs them there.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude || printf '/.whl/\n/.whlnx/\n/.device/\n' >> .git/info/exclude
platforms=()
for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 "${platforms[@]}" --platform any -d "$@"
}
download .whl grpcio==1.85.1 fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection \
    gguf llguidance grpcio-health-checking h11 anyio sniffio click opentelemetry-api importlib-metadata zipp
download .whlnx nixl-cu13  # the nixl pipe on CUDA 13 (install it only in runs that use it)
mkdir -p .device/tok
model=$(ls -d "${DISAGG_CACHE:-$HOME/.cache/disagg}"/models/SmolLM2-135M-Instruct-* | head -1)
cp "$model"/tokenizer.json "$model"/tokenizer_config.json .device/tok/
du -sh .whl .whlnx .device
