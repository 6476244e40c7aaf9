#!/usr/bin/env bash
# One device call for the serving measurements of issue 6, from the repository root.
#
# Steps (named on the command line, in order; default "routing chunked soak"):
#   routing  benchmarks/routing_switch_point.py (L = 1K..32K, B=1, planted): the dense/sparse switch point
#   chunked  benchmarks/chunked_prefill.py at 128K with 8K and 16K chunks (no fp32 reference)
#   soak     benchmarks/soak.py: up to 10,000 pipeline calls, stopped by the time left (--time-limit)
#   tests    the GPU-marked serving tests (pytest -m gpu)
#   transformers  benchmarks/transformers_long_prefill.py: a random 2-layer Llama-3.1-8B-shaped model in
#            transformers, sdpa vs attn_implementation="fpv2" (default sparse settings) at 8K/32K/64K:
#            prefill time, density, top-1 agreement; not in the default steps
# Each step runs under its own time limit; all share FPV2_BUDGET_S. Everything a step writes goes
# to $OUT/<step>/ and is packed into $OUT/serving-results.tgz at the end (the device returns at
# most 8 files); $OUT/serving-device-run.log holds the whole output, and a compact table is
# printed last. Needs no network: the packages run from their src/ folders.
#
# Environment: OUT [fpv2-results/serving], PYTHON [python3], FPV2_BUDGET_S [280],
# FPV2_SOAK_CALLS [10000], FPV2_LIMIT_TESTS / _ROUTING / _CHUNKED / _TRANSFORMERS step limits in
# seconds [120 / 55 / 95 / 200; the soak takes what is left], FPV2_CHUNKED_ARGS (extra chunked_prefill.py
# options), FPV2_TRANSFORMERS_ARGS (extra transformers_long_prefill.py options, e.g. --init-std 0.1),
# FPV2_TEST_PATHS / FPV2_TEST_TIMEOUT (test files, per-test limit), FPV2_COMMIT (recorded in the JSON; the device
# copy has no git).

set -u -o pipefail
export PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT="${OUT:-$ROOT/fpv2-results/serving}"
mkdir -p "$OUT" || exit 1
PYTHON="${PYTHON:-python3}"
BUDGET="${FPV2_BUDGET_S:-280}"
SOAK_CALLS="${FPV2_SOAK_CALLS:-10000}"
export PYTHONPATH="$ROOT/packages/fpv2-kernel/src:$ROOT/packages/fpv2-index/src:$ROOT/packages/fpv2-correction/src:$ROOT/packages/fpv2-serving/src"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$ROOT/fpv2-results/triton-cache}"
export HF_HUB_OFFLINE=1
START=$SECONDS
LOG="$OUT/serving-device-run.log"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(routing chunked soak)
STATUS=()

left() { echo $((BUDGET - (SECONDS - START))); }

run_step() { # run_step NAME LIMIT CMD...
    local name=$1 limit=$2
    shift 2
    local remaining
    remaining=$(left)
    [ "$limit" -gt $((remaining - 8)) ] && limit=$((remaining - 8))
    if [ "$limit" -lt 10 ]; then
        STATUS+=("$name: skipped (no time left)")
        return
    fi
    echo "=== [$name] limit ${limit}s, $(left)s left of ${BUDGET}s" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    STATUS+=("$name: rc=$rc in $((SECONDS - t0))s")
}

for step in "${STEPS[@]}"; do
    case "$step" in
    routing)
        run_step routing "${FPV2_LIMIT_ROUTING:-55}" "$PYTHON" benchmarks/routing_switch_point.py --out "$OUT/routing" \
            --seqlens 1024 2048 4096 8192 16384 32768 --repeats 10 --warmup 2
        ;;
    chunked)
        run_step chunked "${FPV2_LIMIT_CHUNKED:-95}" "$PYTHON" benchmarks/chunked_prefill.py --out "$OUT/chunked" --seqlen 131072 \
            --chunks 8192 16384 --no-error --repeats 10 --warmup 2 ${FPV2_CHUNKED_ARGS:-}
        ;;
    soak)
        # Leave time for the summary, the plot and packing: the soak stops drawing calls on its own.
        limit=$(($(left) - 25))
        run_step soak "$limit" "$PYTHON" benchmarks/soak.py --out "$OUT/soak" --calls "$SOAK_CALLS" \
            --time-limit $((limit - 30)) --no-progress
        ;;
    tests)
        mkdir -p "$OUT/tests"
        # shellcheck disable=SC2086 # FPV2_TEST_PATHS: space-separated test files (default: the whole package)
        run_step tests "${FPV2_LIMIT_TESTS:-120}" "$PYTHON" -m pytest ${FPV2_TEST_PATHS:-packages/fpv2-serving/tests} \
            -m gpu -q -rs -p no:cacheprovider --timeout "${FPV2_TEST_TIMEOUT:-90}" \
            --junitxml="$OUT/tests/junit-gpu-serving.xml"
        ;;
    transformers)
        # The script skips the lengths that would not fit (--time-limit), leaving time to write its files.
        limit=${FPV2_LIMIT_TRANSFORMERS:-200}
        [ "$limit" -gt $(($(left) - 8)) ] && limit=$(($(left) - 8))
        # shellcheck disable=SC2086 # FPV2_TRANSFORMERS_ARGS: space-separated extra options
        run_step transformers "$limit" "$PYTHON" benchmarks/transformers_long_prefill.py --out "$OUT/transformers" \
            --repeats 10 --warmup 2 --time-limit $((limit > 40 ? limit - 20 : limit / 2 + 1)) ${FPV2_TRANSFORMERS_ARGS:-}
        ;;
    *) STATUS+=("$step: unknown step") ;;
    esac
done

# Compact table last: routing switch points, chunked and transformers rows, soak verdicts, test summary.
{
    echo "=== summary (${SECONDS}s)"
    printf '%s\n' "${STATUS[@]}"
    for f in "$OUT"/routing/*.md "$OUT"/chunked/*.md "$OUT"/transformers/*.md; do
        [ -f "$f" ] && { echo "--- ${f#"$OUT"/}"; cat "$f"; }
    done
    grep -h "switch point" "$LOG" || true
    grep -hA12 "^soak: [0-9]" "$LOG" || true
    grep -hE "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$LOG" || true
} | tee -a "$LOG"
# Machine paths out of the results (the repository root becomes "<repo>").
find "$OUT" -type f \( -name '*.json' -o -name '*.md' -o -name '*.log' -o -name '*.xml' \) -print0 |
    xargs -0 -r sed -i "s#$OUT#<out>#g; s#$ROOT#<repo>#g"
(cd "$OUT" && tar czf serving-results.tgz --exclude=serving-results.tgz --exclude=serving-device-run.log \
    $(ls -d routing chunked soak tests transformers 2>/dev/null)) &&
    rm -rf "$OUT"/routing "$OUT"/chunked "$OUT"/soak "$OUT"/tests "$OUT"/transformers
ls -la "$OUT"
