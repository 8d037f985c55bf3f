#!/usr/bin/env bash
# One call on the H200 pair (nvidia-h200-x2), after benchmarks/device_setup.sh here:
#   bash benchmarks/handoff_pair_run.sh PHASE...     carry [".whl", ".device"]
# PHASE: tests (the 2-GPU handoff tests), ttft (layer-wise, then whole, or $MODES; $LENS; $REPEATS a length, 11
# unless set: at 512 tokens two calls' medians of 5 gave 1.08 and 1.45; PROFILE=1: then one
# request of each length under both 1P1D nodes' torch.profiler, traces into $OUT/ttft_MODE_traces.tar), goodput
# (layer-wise; $WORKLOADS, rates $RATES_4K / $RATES_CHAT; PROFILE=1 runs py-spy on the pair's nodes and takes
# torch.profiler traces, PYSPY=1 py-spy alone on a decoding node of each system; CONNECTOR: the KV pipe, torch_dist
# unless set; KV_MEMORY: each node's --kv-cache-memory, unless set 24GiB on H200s and 12GiB on H100s (two nodes share a GPU); ASYNC=1: every node with --async-scheduling (ttft and goodput); SEED: the arrivals' seed (7 + the
# rate's place in the sweep unless set); PREFILL_CHUNK sets the prefill
# node's max-num-batched-tokens), pipes (torch_dist beside nixl: 16 MiB, 256 MiB, a layer list),
# cache (issue 26: cache_aware against least_loaded routing, 2P2D over tcp, shared 4k prefixes; rates
# $RATES_CACHE, $REPEATS_CACHE runs of each, REMOTE_PREFILL=auto|always for the decode nodes, DECODE_KV their
# KV cache, 16GiB unless set), tp (issue 27: the all-reduce alone, then TP=2 against TP=1 in the engine; ASYNC=1 for
# --async-scheduling, PROFILE=1 for its kernel profiles, traces into $OUT/tpprof.tar), gemv (a decode step's
# products on one GPU: cuBLAS against a Triton candidate, at TP=1's and TP=2's shapes), ttft_tp2 (a TP=2 prefill node on both GPUs beside a TP=1 decode node, KV over nixl; $LENS),
# ucx (the ucx pipe's GPU tests, then torch_dist beside ucx at 16 and 256 MiB; carry [".whl-ucx", ".device"] after
# device_setup.sh ucx).
# Each writes its JSON and log under $OUT, traces and node logs as one tar a phase (a call brings back 8
# files at most); the last lines are the summary.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
# Two 8B nodes share a GPU in the ttft and goodput phases: 24 GiB of KV each fits an H200 (141 GB), not an H100 (80).
[ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ] && kv=24GiB || kv=12GiB
common=(--tokenizer-dir .device/tok --gpus 2 --connector "${CONNECTOR:-torch_dist}" --kv-buffer-device cuda --kv-cache-memory "${KV_MEMORY:-$kv}"
        ${ASYNC:+--async-scheduling})
for phase in "$@"; do
    case $phase in
    tests) gpu_tests ;;
    ttft)
        for mode in ${MODES:-layerwise whole}; do
            python3 benchmarks/handoff_h200x2.py "${common[@]}" --phase ttft --lens "${LENS:-512,2048,8192,16384}" \
                --repeats "${REPEATS:-11}" --kv-modes $mode ${PROFILE:+--profile} --json "$out/ttft_$mode.json" 2>&1 \
                | tee "$out/ttft_$mode.log" | tail -8
            tar cf "$out/ttft_${mode}_traces.tar" -C /tmp/handoff_h200x2/logs-ttft-$mode traces 2>/dev/null || true
        done ;;
    goodput)
        python3 benchmarks/handoff_h200x2.py "${common[@]}" --phase goodput --workloads "${WORKLOADS:-4k,chat}" \
            --rates-4k "${RATES_4K:-2,3,4,5,6}" --rates-chat "${RATES_CHAT:-4,8,12,16}" ${PROFILE:+--profile} ${PYSPY:+--pyspy} \
            ${PREFILL_CHUNK:+--prefill-max-num-batched-tokens $PREFILL_CHUNK} \
            --num-requests "${NUM_REQUESTS:-48}" ${SEED:+--seed $SEED} --kv-modes layerwise --json "$out/goodput.json" 2>&1 \
            | tee "$out/goodput.log" | tail -40
        (cd /tmp/handoff_h200x2/logs-goodput && tar cf "$out/goodput_traces.tar" $(ls -d pyspy-* traces 2>/dev/null)) \
            2>/dev/null || true ;;
    cache)
        python3 benchmarks/cache_aware_h200x2.py --tokenizer-dir .device/tok --rates "${RATES_CACHE:-2}" \
            --repeats "${REPEATS_CACHE:-2}" --remote-prefill "${REMOTE_PREFILL:-auto}" \
            ${DECODE_KV:+--decode-kv-cache-memory $DECODE_KV} --json "$out/cache_aware.json" 2>&1 \
            | tee "$out/cache.log" | tail -12
        tar cf "$out/cache-logs.tar" -C /tmp/handoff_h200x2/logs-cache $(cd /tmp/handoff_h200x2/logs-cache && ls *.log) \
            2>/dev/null || true ;;
    tp)
        python3 benchmarks/allreduce_h200x2.py --json "$out/allreduce.json" 2>&1 | tee "$out/allreduce.log" | tail -3
        python3 benchmarks/tp_h200x2.py --tokenizer-dir .device/tok --repeats 3 ${ASYNC:+--async-scheduling} \
            ${PROFILE:+--profile /tmp/tpprof} --json "$out/tp.json" 2>&1 | tee "$out/tp.log" | tail -12
        [ -z "${PROFILE:-}" ] || tar cf "$out/tpprof.tar" -C /tmp tpprof ;;
    gemv)  # one GPU: a decode step's products, cuBLAS against a Triton candidate, at TP=1's and TP=2's shapes
        python3 benchmarks/gemv_shapes.py --json "$out/gemv.json" 2>&1 | tee "$out/gemv.log" | tail -30 ;;
    ttft_tp2)
        # a prefill rank shares GPU 1 with the decode node, which NCCL refuses: nixl (the last --connector wins)
        python3 benchmarks/handoff_h200x2.py "${common[@]}" --connector nixl --phase ttft --prefill-tp 2 \
            --lens "${LENS:-512,2048,8192}" --repeats 5 --kv-modes layerwise --json "$out/ttft_tp2.json" 2>&1 \
            | tee "$out/ttft_tp2.log" | tail -4 ;;
    ucx)  # the ucx pipe between the two GPUs: carry [".whl-ucx", ".device"] (benchmarks/device_setup.sh ucx)
        timeout -s INT -k 30 300 python3 -m pytest -q -p no:cacheprovider tests/test_pipes.py -k "gpu and ucx" 2>&1 \
            | tee "$out/tests_ucx.log" | tail -5
        python3 benchmarks/pipe_bandwidth.py --pipes torch_dist,ucx --sizes 16M,256M --repeats 3 \
            --json "$out/pipes_ucx.json" 2>&1 | tee "$out/pipes_ucx.log" | tail -12 ;;
    pipes)
        python3 benchmarks/pipe_bandwidth.py --pipes torch_dist,nixl --sizes 16M,256M --repeats 3 \
            --json "$out/pipes.json" 2>&1 | tee "$out/pipes.log" | tail -12 ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
    esac
done
