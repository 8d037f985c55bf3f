#!/usr/bin/env bash
# One call on four GPUs (nvidia-h200-x4 or nvidia-h100-x4), after benchmarks/device_setup.sh here:
#   bash benchmarks/xpyd_quad_run.sh PHASE...     carry [".whl", ".device"]
# PHASE: tests (the 2-GPU engine and pipe tests), 4k or chat (xpyd_h200x4.py's goodput phase for that
# workload: colocated x4 first, then $LAYOUTS (of 1p3d, 2p2d, 3p1d, tp2p2d: one TP=2 prefill node and 2
# decode nodes), rates $RATES_4K / $RATES_CHAT, $NUM_REQUESTS a rate),
# plan (`disagg plan` against the goodput JSON files already under $OUT); SLO_FROM: a goodput JSON of an
# earlier call whose SLO this one keeps (then $LAYOUTS need not start with colocated_x4); ASYNC=1: every node with
# --async-scheduling; SEED: the arrivals' seed (as handoff_pair_run.sh's). Each writes its JSON and log under
# $OUT; a later call merges them:
# xpyd_h200x4.py --merge 4k.json chat.json plan.json --json ...
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
common=(--tokenizer-dir .device/tok --connector "${CONNECTOR:-torch_dist}" --num-requests "${NUM_REQUESTS:-40}" ${SEED:+--seed $SEED}
        ${ASYNC:+--async-scheduling})
for phase in "$@"; do
    case $phase in
    tests) gpu_tests ;;
    4k|chat)
        python3 benchmarks/xpyd_h200x4.py "${common[@]}" --phase goodput --workloads "$phase" \
            --layouts "${LAYOUTS:-colocated_x4,1p3d,2p2d,3p1d}" \
            ${RATES_4K:+--rates-4k $RATES_4K} ${RATES_CHAT:+--rates-chat $RATES_CHAT} ${SLO_FROM:+--slo-from $SLO_FROM} \
            --json "$out/$phase.json" 2>&1 | tee "$out/$phase.log" | tail -30 ;;
    plan)
        python3 benchmarks/xpyd_h200x4.py --tokenizer-dir .device/tok --phase plan ${ASYNC:+--async-scheduling} \
            --measured $(ls "$out"/4k.json "$out"/chat.json 2>/dev/null) --json "$out/plan.json" 2>&1 \
            | tee "$out/plan.log" | tail -20 ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
    esac
done
