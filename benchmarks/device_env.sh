# Sourced by the GPU run scripts (handoff_pair_run.sh, xpyd_quad_run.sh) on the GPU machine: installs
# the wheels device_setup.sh fetched (carried in .whl) and sets the environment the nodes and tests need.
# .whl, and .whl-ucx for the ucx phase (device_setup.sh ucx): each wheel once, by name (a warm machine may keep both)
wheels=() && declare -A named=()
for wheel in .whl/*.whl .whl-ucx/*.whl; do
    [ -f "$wheel" ] && [ -z "${named[$(basename "$wheel")]:-}" ] && named[$(basename "$wheel")]=1 && wheels+=("$wheel")
done
if [ ${#wheels[@]} -gt 0 ]; then
    # --upgrade: a second call on the same machine replaces what the first installed (else pip keeps it)
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}" || exit 1
fi
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 DISAGG_TEST_TOKENIZER_DIR=.device/tok
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

gpu_tests() {  # the 2-GPU engine and pipe tests, first in any call that measures; nixl's in a process of their own
    # A test that stalls prints every thread's stack after 150 s (pytest's faulthandler_timeout), and the run
    # ends after ${TESTS_LIMIT_S:-360} s (they take about 160), so that a hang leaves the call's later phases their time.
    timeout -s INT -k 30 "${TESTS_LIMIT_S:-360}" python3 -m pytest -q -p no:cacheprovider --durations=8 -o faulthandler_timeout=150 \
        tests/test_gpu_engine.py tests/test_pipes.py -k gpu 2>&1 | tee "$out/tests.log" | tail -14
    DISAGG_TEST_NIXL=1 timeout -s INT -k 30 120 python3 -m pytest -q -p no:cacheprovider tests/test_pipes.py -k "gpu and nixl" 2>&1 \
        | tee "$out/tests_nixl.log" | tail -5
}
