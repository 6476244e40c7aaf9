#!/usr/bin/env bash
# One-call device check of the sm_90a prefill kernel (dense, block-sparse, mean correction), from the repository root.
#
# Builds the native test programs of packages/fpv2-kernel (-DFPV2_BUILD_HOPPER_KERNEL=ON), then:
#   1. the ptxas report of the kernel (registers, spills, barriers) and a SASS census (HGMMA, UTMALDG,
#      USETMAXREG, local memory) from cuobjdump;
#   2. fpv2_hopper_layout_check (host-only index algebra);
#   3. fpv2_hopper_prefill_test --mode correctness (refusals + the case grid against the fp32 reference);
#   4. fpv2_hopper_prefill_test --mode timing (L = 32K and 128K, B=1, Hq=32, Hkv=8: median of 10, TFLOP/s;
#      dense, then sparse at HOPPER_KEEP without and with the correction);
#   5. compute-sanitizer memcheck (and racecheck, reported but not fatal) on --mode small.
# Every step runs even when an earlier one failed (a failed build skips the programs); the script exits 1
# if any step failed. Steps share a time budget (HOPPER_BUDGET_S) inside the device's 10-minute limit.
#
# The device machine has no network and no nvidia-cutlass wheel: carry the CUTLASS headers. From the
# repository root on the development machine (.carry/ is git-ignored):
#   mkdir -p .carry/cutlass && cp -r "$(python -c "import importlib.util as u; \
#     print(u.find_spec('cutlass_library').submodule_search_locations[0])")/source/include" .carry/cutlass/
# then run `scripts/hopper_check.sh` with carry [".carry"].
#
# $OUT receives at most 8 flat files: hopper_check.log (everything, ptxas summary and final table),
# build.log, kernel.sass, layout_check.log, correctness.log, timing.log, sanitizer.log, results.jsonl.
#
# Environment (defaults in brackets):
#   OUT                  output folder [fpv2-results/hopper-check]
#   FPV2_CUTLASS_DIR     CUTLASS include dir [.carry/cutlass/include if present, else the wheel's]
#   HOPPER_BUILD_DIR     build folder [/tmp/fpv2-hopper-build]
#   HOPPER_JOBS          build parallelism [nproc]
#   HOPPER_BUDGET_S      seconds for the whole script [560]
#   HOPPER_LENGTHS       timing lengths ["32768,131072"]
#   HOPPER_REPEATS       timed runs per length [10]
#   HOPPER_KEEP          probability of keeping a block below the diagonal band in the sparse timing [0.03]
#   HOPPER_PAGES         page sizes timed, space separated ["128 1": the TMA path and the cp.async gather]
#   HOPPER_HEAD_DIMS     built head dims other than 128 to time at page size 128, space separated [""]
#   HOPPER_PINGPONG      1: also check and time the FPV2_HOPPER_PINGPONG=1 schedule at page size 128 [1]
#   HOPPER_PERSISTENT    1: also check and time FPV2_HOPPER_PERSISTENT=1 (persistent CTAs) at page size 128 [1]
#   HOPPER_OVERLAP       1: also check and time FPV2_HOPPER_OVERLAP=0 (the consumers without the default's
#                        PV/softmax overlap, their own instantiation) at every page of HOPPER_PAGES, and
#                        memcheck it [1]
#   HOPPER_SEED          input seed offset [seconds since the epoch, printed]
#   HOPPER_SKIP_RACECHECK=1   skip the racecheck run
#   CUOBJDUMP, COMPUTE_SANITIZER   tool paths [PATH, then /usr/local/cuda/bin]

set -u -o pipefail
export PYTHONUNBUFFERED=1

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT="${OUT:-$ROOT/fpv2-results/hopper-check}"
mkdir -p "$OUT" || exit 1
OUT="$(cd "$OUT" && pwd)"
BUILD="${HOPPER_BUILD_DIR:-/tmp/fpv2-hopper-build}"
JOBS="${HOPPER_JOBS:-$(nproc)}"
BUDGET="${HOPPER_BUDGET_S:-560}"
LENGTHS="${HOPPER_LENGTHS:-32768,131072}"
REPEATS="${HOPPER_REPEATS:-10}"
KEEP="${HOPPER_KEEP:-0.03}"
PAGES="${HOPPER_PAGES:-128 1}"
HEAD_DIMS="${HOPPER_HEAD_DIMS:-}"
PINGPONG="${HOPPER_PINGPONG:-1}"
PERSISTENT="${HOPPER_PERSISTENT:-1}"
OVERLAP="${HOPPER_OVERLAP:-1}"
SEED="${HOPPER_SEED:-$(date +%s)}"
START=$SECONDS
FAILED=()
STATUS=()

remaining() { echo $((BUDGET - (SECONDS - START))); }

# run_step NAME TIMEOUT LOG CMD...: run one step under a time limit, tee its output to LOG, record the result.
run_step() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$(($(remaining) - 10))
    if ((left < 10)); then
        echo "!!! [$name] skipped: the time budget of ${BUDGET}s is spent"
        FAILED+=("$name (skipped: out of time)")
        STATUS+=("SKIP  $name (out of time)")
        return 1
    fi
    ((limit > left)) && limit=$left
    echo
    echo "=== [$name] (limit ${limit}s) $*"
    local t0=$SECONDS rc
    # Steps may be shell functions: run them in a child bash (they are exported) under timeout.
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    if ((rc == 0)); then
        STATUS+=("ok    $name (${took}s)")
    else
        local why="exit $rc"
        ((rc == 124 || rc == 137)) && why="timed out after ${limit}s"
        echo "!!! [$name] failed: $why"
        FAILED+=("$name ($why)")
        STATUS+=("FAIL  $name ($why, ${took}s)")
    fi
    return $rc
}

find_tool() {
    local name=$1 candidate override
    override="$(echo "$name" | tr 'a-z-' 'A-Z_')"  # CUOBJDUMP, COMPUTE_SANITIZER
    for candidate in "${!override:-}" "$(command -v "$name" 2>/dev/null)" "/usr/local/cuda/bin/$name" \
        "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")/$name"; do
        [[ -n "$candidate" && -x "$candidate" ]] && {
            echo "$candidate"
            return 0
        }
    done
    return 1
}

configure_and_build() {
    local cutlass_args=()
    local dir="${FPV2_CUTLASS_DIR:-}"
    [[ -z "$dir" && -f "$ROOT/.carry/cutlass/include/cute/tensor.hpp" ]] && dir="$ROOT/.carry/cutlass/include"
    [[ -n "$dir" ]] && cutlass_args=(-DFPV2_CUTLASS_DIR="$dir")
    cmake -S packages/fpv2-kernel -B "$BUILD" -G Ninja -DFPV2_BUILD_NATIVE=ON -DFPV2_BUILD_HOPPER_KERNEL=ON \
        -DCMAKE_BUILD_TYPE=Release "${cutlass_args[@]}" || return 1
    local t0=$SECONDS
    # -v prints each nvcc command line; the ptxas report follows its compile.
    cmake --build "$BUILD" -j "$JOBS" -v --target fpv2_hopper_prefill_test fpv2_hopper_layout_check || return 1
    echo "hopper targets built in $((SECONDS - t0))s with $JOBS jobs"
}

ptxas_and_sass() {
    echo "--- ptxas report of the kernel (from build.log)"
    # Per built head dim, three instantiations: one CTA per tile, persistent (opt-in), overlapped consumers.
    grep -A3 "Compiling entry function '.*prefill_kernel" "$OUT/build.log" || echo "(no ptxas report found)"
    grep -n "C7508\|setmaxnreg" "$OUT/build.log" && echo "!!! setmaxnreg warning above"
    # Stack frame and spill budget per instantiation (the producer's known few bytes pass; kernel state
    # moved to local memory does not).
    python3 "$ROOT/packages/fpv2-kernel/tools/check_ptxas_report.py" "$OUT/build.log" || return 1
    local cuobjdump
    cuobjdump="$(find_tool cuobjdump)" || {
        echo "cuobjdump not found"
        return 1
    }
    # The test program also holds the reference and fill kernels: keep only the prefill kernel's SASS.
    "$cuobjdump" --dump-sass "$BUILD/fpv2_hopper_prefill_test" 2>/dev/null |
        awk '/Function : /{keep = ($0 ~ /prefill_kernel/)} keep' >"$OUT/kernel.sass" || return 1
    [[ -s "$OUT/kernel.sass" ]] || {
        echo "!!! no prefill_kernel SASS found"
        return 1
    }
    "$cuobjdump" --dump-resource-usage "$BUILD/fpv2_hopper_prefill_test" 2>/dev/null | grep -A1 "prefill_kernel"
    echo "--- SASS census (counts of instruction forms)"
    local forms="HGMMA[.A-Z0-9x]*|UTMALDG[.A-Z0-9]*|USETMAXREG[._A-Z]*|LDGSTS[.A-Z0-9]*|SYNCS[.A-Z0-9]*"
    grep -oE "$forms|\bLDL[.A-Z0-9]*|\bSTL[.A-Z0-9]*" "$OUT/kernel.sass" | sort | uniq -c
    grep -q "HGMMA" "$OUT/kernel.sass" && grep -q "UTMALDG" "$OUT/kernel.sass" || {
        echo "!!! HGMMA or UTMALDG missing from the SASS"
        return 1
    }
    # Local memory is reported, not fatal: the budget check above is the gate (the producer's 24 registers
    # spill a few bytes by design).
    grep -qE "\bLDL|\bSTL" "$OUT/kernel.sass" && echo "(local-memory loads/stores in the kernel: $(grep -cE "\bLDL|\bSTL" "$OUT/kernel.sass"))"
    return 0
}

sanitize() {
    local sanitizer tool
    sanitizer="$(find_tool compute-sanitizer)" || {
        echo "compute-sanitizer not found"
        return 1
    }
    "$sanitizer" --tool memcheck --error-exitcode 3 "$BUILD/fpv2_hopper_prefill_test" --mode small --seed "$SEED" ||
        return $?
    if [[ "$PINGPONG" == 1 || "$PERSISTENT" == 1 ]]; then
        echo "--- memcheck of the opt-in variants (pingpong=$PINGPONG persistent=$PERSISTENT)"
        env FPV2_HOPPER_PINGPONG="$PINGPONG" FPV2_HOPPER_PERSISTENT="$PERSISTENT" \
            "$sanitizer" --tool memcheck --error-exitcode 3 "$BUILD/fpv2_hopper_prefill_test" --mode small \
            --seed "$SEED" || return $?
    fi
    if [[ "$OVERLAP" == 1 ]]; then  # its own instantiation: memcheck it on its own
        echo "--- memcheck of the consumers without overlap (FPV2_HOPPER_OVERLAP=0)"
        env FPV2_HOPPER_OVERLAP=0 "$sanitizer" --tool memcheck --error-exitcode 3 "$BUILD/fpv2_hopper_prefill_test" \
            --mode small --seed "$SEED" || return $?
    fi
    if [[ "${HOPPER_SKIP_RACECHECK:-0}" != 1 ]]; then
        echo "--- racecheck (informational: reported, not fatal)"
        "$sanitizer" --tool racecheck --racecheck-report all "$BUILD/fpv2_hopper_prefill_test" --mode small \
            --seed "$SEED" || echo "(racecheck exit status $?)"
    fi
    return 0
}

main() {
    echo "fpv2 Hopper prefill check, $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s, seed $SEED"
    # The device's copy of the tree may carry a stale .git: name the code by the hash of its native sources
    # (compare with `scripts/hopper_check.sh`'s same line run on a commit), and the commit only as a hint.
    echo "native sources sha256: $(cd "$ROOT/packages/fpv2-kernel" && find csrc include tests/native CMakeLists.txt \
        -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)"
    echo "git HEAD (may be stale on the device): $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo none)"
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
    nvcc --version | tail -1
    : >"$OUT/build.log"
    if run_step build 360 "$OUT/build.log" configure_and_build; then
        run_step ptxas-sass 60 /dev/null ptxas_and_sass
        run_step layout-check 60 "$OUT/layout_check.log" "$BUILD/fpv2_hopper_layout_check"
        run_step correctness 150 "$OUT/correctness.log" "$BUILD/fpv2_hopper_prefill_test" --mode correctness \
            --seed "$SEED"
        local page
        for page in $PAGES; do
            run_step "timing page=$page" 120 "$OUT/timing.log" "$BUILD/fpv2_hopper_prefill_test" --mode timing \
                --lengths "$LENGTHS" --repeats "$REPEATS" --keep "$KEEP" --page-size "$page" --seed "$SEED"
        done
        local head_dim
        for head_dim in $HEAD_DIMS; do
            run_step "timing page=128 d=$head_dim" 120 "$OUT/timing.log" "$BUILD/fpv2_hopper_prefill_test" \
                --mode timing --head-dim "$head_dim" --lengths "$LENGTHS" --repeats "$REPEATS" --keep "$KEEP" \
                --page-size 128 --seed "$SEED"
        done
        if [[ "$PINGPONG" == 1 ]]; then
            # The consumers' pingpong schedule (kernel variant selected by FPV2_HOPPER_PINGPONG=1): grid, then
            # the TMA-path timing.
            run_step "correctness pingpong" 150 "$OUT/correctness.log" env FPV2_HOPPER_PINGPONG=1 \
                "$BUILD/fpv2_hopper_prefill_test" --mode correctness --seed "$SEED"
            run_step "timing page=128 pingpong" 120 "$OUT/timing.log" env FPV2_HOPPER_PINGPONG=1 \
                "$BUILD/fpv2_hopper_prefill_test" --mode timing --lengths "$LENGTHS" --repeats "$REPEATS" \
                --keep "$KEEP" --page-size 128 --seed "$SEED"
        fi
        if [[ "$PERSISTENT" == 1 ]]; then
            # Persistent CTAs (kernel variant selected by FPV2_HOPPER_PERSISTENT=1): grid, then the timings.
            run_step "correctness persistent" 150 "$OUT/correctness.log" env FPV2_HOPPER_PERSISTENT=1 \
                "$BUILD/fpv2_hopper_prefill_test" --mode correctness --seed "$SEED"
            run_step "timing page=128 persistent" 120 "$OUT/timing.log" env FPV2_HOPPER_PERSISTENT=1 \
                "$BUILD/fpv2_hopper_prefill_test" --mode timing --lengths "$LENGTHS" --repeats "$REPEATS" \
                --keep "$KEEP" --page-size 128 --seed "$SEED"
        fi
        if [[ "$OVERLAP" == 1 ]]; then
            # Consumers without overlap (kernel variant selected by FPV2_HOPPER_OVERLAP=0): grid, then every page.
            run_step "correctness no-overlap" 150 "$OUT/correctness.log" env FPV2_HOPPER_OVERLAP=0 \
                "$BUILD/fpv2_hopper_prefill_test" --mode correctness --seed "$SEED"
            for page in $PAGES; do
                run_step "timing page=$page no-overlap" 120 "$OUT/timing.log" env FPV2_HOPPER_OVERLAP=0 \
                    "$BUILD/fpv2_hopper_prefill_test" --mode timing --lengths "$LENGTHS" --repeats "$REPEATS" \
                    --keep "$KEEP" --page-size "$page" --seed "$SEED"
            done
        fi
        grep "^RESULT " "$OUT/timing.log" | sed 's/^RESULT //' >"$OUT/results.jsonl"
        run_step sanitizer 150 "$OUT/sanitizer.log" sanitize
    fi
    echo
    echo "=== summary ($((SECONDS - START))s)"
    grep -A3 "Compiling entry function '.*prefill_kernel" "$OUT/build.log" | grep -E "spill|registers" || true
    grep -hE "^\[(PASS|FAIL)\]|^(PASS|FAIL):" "$OUT/correctness.log" "$OUT/timing.log" 2>/dev/null | cut -c1-220
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer.log" 2>/dev/null
    printf '  %s\n' "${STATUS[@]}"
    if ((${#FAILED[@]})); then
        echo "hopper_check: ${#FAILED[@]} step(s) failed: $(IFS=';'; echo "${FAILED[*]}")"
        return 1
    fi
    echo "hopper_check: all steps passed"
}

export -f configure_and_build ptxas_and_sass sanitize find_tool
export ROOT OUT BUILD JOBS SEED PINGPONG PERSISTENT OVERLAP
main 2>&1 | tee "$OUT/hopper_check.log"
exit "${PIPESTATUS[0]}"
