#!/usr/bin/env bash
# Run HERE (not on the GPU machine), from the repository root, before the device calls: fetches what
# the GPU machine lacks for disagg's nodes as Python 3.12 wheels into .whl/ (its image
# has torch, triton, transformers, prometheus-client, tokenizers, and a grpcio older than the
# generated stubs need; not fastapi nor the opentelemetry-api it imports, uvicorn, gguf, llguidance,
# NIXL), and the embedded model's tokenizer into .device/tok. Both are git-ignored; carry [".whl", ".device"] (64 MiB a call).
# NIXL's wheel (57 MB) is slimmed to fit beside the rest: its expert-parallel kernels (nixl_ep, three
# 31 MB builds) and UCX's perftest plugin are dropped, and its RECORD with them.
# `device_setup.sh ucx` also fills .whl-ucx/ for the ucx pipe's GPU path: .whl's wheels but NIXL's, ucxx-cu13 and
# what it needs (rmm, cuda-bindings, cuda-core; libucx without its static libraries, tools and headers:
# 42 -> 12 MB); carry [".whl-ucx", ".device"] for `handoff_pair_run.sh ucx` (53 MB; both sets together would not fit).
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
    gguf llguidance grpcio-health-checking h11 anyio sniffio click opentelemetry-api importlib-metadata zipp \
    aiohttp multidict yarl propcache frozenlist aiosignal aiohappyeyeballs attrs idna
download /tmp/disagg-nixl nixl-cu13  # the nixl pipe on CUDA 13
rm -rf /tmp/disagg-nixl/x && mkdir /tmp/disagg-nixl/x
(cd /tmp/disagg-nixl/x && unzip -q ../nixl_cu13-*.whl && rm -rf nixl_ep_cu13 nixl_cu13.libs/ucx/libucx_perftest* \
    && sed -i -e '/^nixl_ep_cu13\//d' -e '/libucx_perftest/d' ./*.dist-info/RECORD \
    && rm -f "$OLDPWD"/.whl/nixl_cu13-*.whl && zip -q -r -9 "$OLDPWD/.whl/$(basename ../nixl_cu13-*.whl)" .)
slim_libucx() {  # $1: a libucx wheel, rewritten without what loading UCX from Python does not need
    local dir whl
    dir=$(mktemp -d) whl=$(realpath "$1")
    # libucx's loader opens lib/*.so and UCX its modules by the same names; the libraries' own links use
    # *.so.0: both stay, the *.so.0.0.0 copies go.
    (cd "$dir" && unzip -q "$whl" && rm -rf libucx/bin libucx/include libucx/share libucx/lib/cmake libucx/lib/pkgconfig \
        && find libucx/lib \( -name '*.a' -o -name '*.la' -o -name '*.so.0.0.0' -o -name 'libucx_perftest*' \) -delete \
        && python3 -c 'import glob, os; r = glob.glob("*.dist-info/RECORD")[0]; keep = [l for l in open(r) if os.path.exists(l.split(",")[0])]; open(r, "w").writelines(keep)' \
        && rm "$whl" && zip -q -r -9 "$whl" .)
    rm -rf "$dir"
}
if [ "${1:-}" = ucx ]; then
    rm -rf .whl-ucx && mkdir .whl-ucx
    find .whl -type f -name '*.whl' ! -name 'nixl*' -exec cp {} .whl-ucx/ \;
    download .whl-ucx ucxx-cu13 'libucx-cu13<1.22' libucxx-cu13 'rmm-cu13==26.10.*' 'librmm-cu13==26.10.*' \
        'rapids-logger==0.3.*' 'cuda-bindings>=13.0.1,<14' cuda-core cuda-pathfinder nvidia-ml-py
    slim_libucx .whl-ucx/libucx_cu13-*.whl
    du -sh .whl-ucx
fi
mkdir -p .device/tok
model=$(ls -d "${DISAGG_CACHE:-$HOME/.cache/disagg}"/models/SmolLM2-135M-Instruct-* | head -1)
cp "$model"/tokenizer.json "$model"/tokenizer_config.json .device/tok/
du -sh .whl .device
