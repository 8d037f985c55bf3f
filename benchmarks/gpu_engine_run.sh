#!/usr/bin/env bash
# One call on the GPU machine: the kernel and engine tests on CUDA, then the roofline benchmark.
#   bash benchmarks/gpu_engine_run.sh TOKENIZER_DIR OUT_DIR [roofline args...]
set -uo pipefail
tok=$1 out=$2
shift 2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 DISAGG_TEST_TOKENIZER_DIR=$tok
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_gpu_engine.py 2>&1 | tee "$out/tests.log" | tail -25
python3 benchmarks/engine_roofline.py --tokenizer-dir "$tok" --json "$out/engine_roofline.json" --profile "$out/host_profile.txt" --kernel-profile "$out/kernel_profile.txt" "$@" 2>&1 | tee "$out/roofline.log"
