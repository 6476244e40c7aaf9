#!/usr/bin/env bash
# One-call device check: environment, GPU tests and benchmarks of fpv2, from the repository root.
#
# Runs on a GPU machine without network. Puts the four packages' src/ folders on
# PYTHONPATH (or, with FPV2_INSTALL=pip, tries `pip install --no-build-isolation
# --no-deps` first), points FPV2_KERNEL_LIBRARY at .carry/lib/libfpv2_kernel.so when
# that prebuilt library was carried, then:
#   1. nvidia-smi and `fpv2 info`
#   2. the GPU-marked tests of every package (JUnit XML and log under $OUT)
#   3. `fpv2 bench` at each size of FPV2_BENCH_SEQLENS
#   4. merged results under $OUT and a short table, printed last
# Every step runs even when an earlier one failed; the script exits 1 if any step
# failed. Steps share a time budget (FPV2_BUDGET_S) so the whole call ends inside
# the device's 10-minute command limit.
#
# $OUT receives at most 8 flat files (the device returns no more): device_check.log,
# pytest-gpu.xml, pytest-gpu.log, h200-summary.json (the flat records of
# BENCHMARKS.md), bench-results.json (every results file) and up to 3 heatmaps.
#
# Environment (defaults in brackets):
#   OUT                      output folder [fpv2-results/device-check]
#   PYTHON                   interpreter [python3]
#   FPV2_INSTALL             "pip" to try a pip install first [PYTHONPATH only]
#   FPV2_BUDGET_S            seconds for the whole script [570]
#   FPV2_PYTEST_TIMEOUT      seconds for the tests [300] (the first Triton compiles of the grid take ~2 min)
#   FPV2_PYTEST_MARKERS      pytest -m expression ["gpu or hopper"]
#   FPV2_PYTEST_ARGS         extra pytest arguments []
#   FPV2_TEST_PACKAGES       packages to test, e.g. "fpv2-serving fpv2-index" [all]
#   FPV2_BENCH_TIMEOUT       seconds per bench size [270]
#   FPV2_BENCH_SEQLENS       sequence lengths, space separated ["8192 32768"]
#   FPV2_BENCH_BATCH / _Q_HEADS / _KV_HEADS / _HEAD_DIM / _DTYPE / _PAGE_SIZE
#                            [1 / 32 / 8 / 128 / bf16 / 1]
#   FPV2_BENCH_ALPHAS        alphas, space separated ["0.1"]
#   FPV2_BENCH_ARGS          extra `fpv2 bench` arguments, e.g. "--ablation" []
#   FPV2_SKIP_TESTS / FPV2_SKIP_BENCH   set to 1 to skip a step
#   FPV2_COMMIT              commit recorded in the results [git, or .carry/COMMIT]

set -u -o pipefail
export PYTHONUNBUFFERED=1

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT="${OUT:-$ROOT/fpv2-results/device-check}"
mkdir -p "$OUT" || exit 1
OUT="$(cd "$OUT" && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fpv2-device-check.XXXXXX")"
START=$SECONDS
BUDGET="${FPV2_BUDGET_S:-570}"
RESERVE=20 # seconds kept for merging the results and printing the table

FAILED=()
STATUS=()

remaining() { echo $((BUDGET - (SECONDS - START))); }

# run_step NAME TIMEOUT CMD...: run one step under a time limit, record how it went.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$(($(remaining) - RESERVE))
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
    # Steps are shell functions: run them in a child bash (they are exported) under timeout,
    # which signals the whole process group when the limit is reached.
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@"
    rc=$?
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

setup_python() {
    export PYTHONPATH="$ROOT/packages/fpv2-kernel/src:$ROOT/packages/fpv2-index/src:$ROOT/packages/fpv2-correction/src:$ROOT/packages/fpv2-serving/src${PYTHONPATH:+:$PYTHONPATH}"
    if [[ "${FPV2_INSTALL:-}" == pip ]]; then
        echo "=== [install] pip install --no-build-isolation --no-deps (four packages)"
        if timeout 300 "$PYTHON" -m pip install -q --no-build-isolation --no-deps \
            packages/fpv2-kernel packages/fpv2-index packages/fpv2-correction packages/fpv2-serving; then
            unset PYTHONPATH # the installed wheels (with their native library) take over
            STATUS+=("ok    install (pip)")
        else
            echo "!!! [install] pip install failed: falling back to the src/ folders on PYTHONPATH"
            FAILED+=("install (pip failed, used PYTHONPATH)")
            STATUS+=("FAIL  install (pip failed, used PYTHONPATH)")
        fi
    fi
    if [[ -z "${FPV2_KERNEL_LIBRARY:-}" && -f "$ROOT/.carry/lib/libfpv2_kernel.so" ]]; then
        export FPV2_KERNEL_LIBRARY="$ROOT/.carry/lib/libfpv2_kernel.so"
    fi
    if [[ -z "${FPV2_COMMIT:-}" ]]; then
        # Only when ROOT is itself a checkout: an exported tree inside another checkout (e.g. carried
        # under .carry/) must not report the enclosing repository's commit.
        if [[ "$(git -C "$ROOT" rev-parse --show-toplevel 2>/dev/null)" == "$ROOT" ]]; then
            FPV2_COMMIT="$(git -C "$ROOT" rev-parse HEAD)"
            git -C "$ROOT" diff --quiet HEAD -- 2>/dev/null || FPV2_COMMIT="$FPV2_COMMIT-dirty"
        elif [[ -f "$ROOT/.carry/COMMIT" ]]; then
            FPV2_COMMIT="$(tr -d '[:space:]' <"$ROOT/.carry/COMMIT")"
        else
            FPV2_COMMIT=unknown
        fi
    fi
    export FPV2_COMMIT
    echo "PYTHONPATH=${PYTHONPATH:-<unset>}"
    echo "FPV2_KERNEL_LIBRARY=${FPV2_KERNEL_LIBRARY:-<unset>}"
    echo "FPV2_COMMIT=$FPV2_COMMIT"
}

fpv2() { "$PYTHON" -m fpv2.serving "$@"; }

step_gpu_info() {
    nvidia-smi || return 1
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm --format=csv
}

step_tests() {
    local markers="${FPV2_PYTEST_MARKERS:-gpu or hopper}" pkg rc failed_rc=0 any_run=0
    : >"$OUT/pytest-gpu.log"
    # One pytest per package, from its folder: each gets its own configuration, conftest and
    # test helpers, and equal test file names in two packages cannot clash.
    for pkg in packages/*/; do
        pkg=${pkg%/}
        [[ -d "$pkg/tests" ]] || continue
        if [[ -n "${FPV2_TEST_PACKAGES:-}" && " $FPV2_TEST_PACKAGES " != *" $(basename "$pkg") "* ]]; then
            continue
        fi
        echo "--- pytest -m '$markers' $pkg/tests" | tee -a "$OUT/pytest-gpu.log"
        # shellcheck disable=SC2086
        (cd "$pkg" && "$PYTHON" -m pytest -m "$markers" -p no:cacheprovider -rfEs \
            --junitxml="$WORK/junit-$(basename "$pkg").xml" -o junit_family=xunit2 ${FPV2_PYTEST_ARGS:-} tests) \
            2>&1 | tee -a "$OUT/pytest-gpu.log"
        rc=${PIPESTATUS[0]}
        if ((rc == 5)); then
            echo "($pkg: no test matched -m '$markers')"
        elif ((rc != 0)); then
            failed_rc=$rc
        else
            any_run=1
        fi
    done
    "$PYTHON" - "$WORK" "$OUT/pytest-gpu.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

merged = ET.Element("testsuites")
for path in sorted(Path(sys.argv[1]).glob("junit-*.xml")):
    root = ET.parse(path).getroot()
    for suite in root.iter("testsuite"):
        suite.set("name", path.stem.removeprefix("junit-"))
        merged.append(suite)
ET.ElementTree(merged).write(sys.argv[2], encoding="utf-8", xml_declaration=True)
PY
    if ((failed_rc != 0)); then
        return "$failed_rc"
    fi
    if ((!any_run)); then
        echo "no test of any package matched -m '$markers'"
        return 5
    fi
    return 0
}

step_bench() {
    local seqlen=$1 alphas=() a
    for a in ${FPV2_BENCH_ALPHAS:-0.1}; do alphas+=(--alpha "$a"); done
    # shellcheck disable=SC2086
    fpv2 bench -B "${FPV2_BENCH_BATCH:-1}" -L "$seqlen" --q-heads "${FPV2_BENCH_Q_HEADS:-32}" \
        --kv-heads "${FPV2_BENCH_KV_HEADS:-8}" --head-dim "${FPV2_BENCH_HEAD_DIM:-128}" \
        --dtype "${FPV2_BENCH_DTYPE:-bf16}" --page-size "${FPV2_BENCH_PAGE_SIZE:-1}" "${alphas[@]}" \
        --no-progress --out "$WORK/bench-L$seqlen" ${FPV2_BENCH_ARGS:-}
}

# Merge every bench folder into $OUT (within its 8-file limit) and print the short table.
step_collect() {
    "$PYTHON" - "$WORK" "$OUT" "$ROOT" <<'PY'
import json
import os
import shutil
import sys
from pathlib import Path

work, out, root = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
summary, results, pngs = [], [], []


def relative(text: str) -> str:
    """Results get committed: keep this machine's folders out of them."""
    text = text.replace(str(work), "<workdir>")
    return text.replace(root, ".") if root else text


for folder in sorted(work.glob("bench-L*"), key=lambda p: int(p.name[len("bench-L"):])):
    if (folder / "summary.json").exists():
        summary += json.loads((folder / "summary.json").read_text())
    results += [json.loads(p.read_text()) for p in sorted(folder.glob("bench-*.json"))]
    pngs += sorted(folder.glob("*.png"))
(out / "h200-summary.json").write_text(relative(json.dumps(summary, indent=2)) + "\n")
(out / "bench-results.json").write_text(relative(json.dumps(results, indent=2)) + "\n")
for png in pngs[:3]:
    shutil.copy(png, out / png.name)
if len(pngs) > 3:
    print(f"note: {len(pngs) - 3} heatmap(s) not copied to $OUT (the device returns 8 files at most)")

def f(v, spec):
    return "-" if v is None else format(v, spec)

print()
print(f"{'impl':<22} {'dtype':<5} {'B':>2} {'L':>7} {'alpha':>6} {'corr':>4} {'ms':>10} {'index':>9} "
      f"{'density':>7} {'rel_err':>8} {'TFLOP/s':>8} {'speedup':>7}")
for r in summary:
    corr = ("on" if r["correction"] else "off") if r["impl"].startswith("fpv2-sparse") else "-"
    print(f"{r['impl']:<22} {r['dtype']:<5} {r['B']:>2} {r['L']:>7} {f(r.get('alpha'), '.3g'):>6} {corr:>4} "
          f"{f(r['ms'], '.3f'):>10} {f(r['index_ms'], '.3f'):>9} {f(r['density'], '.3f'):>7} "
          f"{f(r['rel_err'], '.4f'):>8} {f(r['tflops'], '.1f'):>8} {f(r.get('speedup'), '.2f'):>7}")
if not summary:
    print("(no benchmark records)")
    sys.exit(0 if os.environ.get("FPV2_SKIP_BENCH") == "1" else 1)
PY
}

main() {
    echo "fpv2 device check, $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s"
    setup_python
    run_step gpu-info 60 step_gpu_info
    run_step fpv2-info 120 fpv2 info
    if [[ "${FPV2_SKIP_TESTS:-0}" != 1 ]]; then
        run_step gpu-tests "${FPV2_PYTEST_TIMEOUT:-300}" step_tests
    fi
    if [[ "${FPV2_SKIP_BENCH:-0}" != 1 ]]; then
        local seqlen
        for seqlen in ${FPV2_BENCH_SEQLENS:-8192 32768}; do
            run_step "bench L=$seqlen" "${FPV2_BENCH_TIMEOUT:-270}" step_bench "$seqlen"
        done
    fi
    echo
    echo "=== steps ($((SECONDS - START))s)"
    printf '  %s\n' "${STATUS[@]}"
    RESERVE=0 run_step collect 60 step_collect
    echo
    if ((${#FAILED[@]})); then
        echo "device_check: ${#FAILED[@]} step(s) failed: $(IFS=';'; echo "${FAILED[*]}")"
        return 1
    fi
    echo "device_check: all steps passed"
}

export -f fpv2 step_gpu_info step_tests step_bench step_collect 2>/dev/null
export PYTHON OUT WORK ROOT
main 2>&1 | tee "$OUT/device_check.log"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"
