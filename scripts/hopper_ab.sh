#!/usr/bin/env bash
# A/B timing of two builds of the native Hopper test program, alternating runs so that clock and thermal
# drift hit both alike. From the repository root:
#   HOPPER_AB_BASE=<base binary> HOPPER_AB_NEW=<new binary> scripts/hopper_ab.sh
# Environment (defaults in brackets):
#   HOPPER_AB_PAIRS     alternating (base, new) pairs [3]
#   HOPPER_AB_LENGTHS   --lengths ["32768,131072"]
#   HOPPER_AB_PAGE      --page-size [128]
#   HOPPER_AB_REPEATS   timed runs per case and run [10]
#   HOPPER_AB_KEEP      --keep [0.03]
#   HOPPER_AB_SEED      --seed [5]
# Prints every RESULT line tagged base/new, then the median over runs of each case's median (ms) per build.
set -u -o pipefail
BASE="${HOPPER_AB_BASE:?set HOPPER_AB_BASE}"
NEW="${HOPPER_AB_NEW:?set HOPPER_AB_NEW}"
PAIRS="${HOPPER_AB_PAIRS:-3}"
LENGTHS="${HOPPER_AB_LENGTHS:-32768,131072}"
PAGE="${HOPPER_AB_PAGE:-128}"
REPEATS="${HOPPER_AB_REPEATS:-10}"
KEEP="${HOPPER_AB_KEEP:-0.03}"
SEED="${HOPPER_AB_SEED:-5}"
LOG="$(mktemp)"
for ((pair = 0; pair < PAIRS; ++pair)); do
    for tag in base new; do
        binary=$BASE
        [[ $tag == new ]] && binary=$NEW
        "$binary" --mode timing --lengths "$LENGTHS" --repeats "$REPEATS" --keep "$KEEP" --page-size "$PAGE" \
            --seed "$SEED" 2>&1 | sed -n "s/^RESULT /$tag /p" | tee -a "$LOG"
    done
done
python3 - "$LOG" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    tag, _, payload = line.partition(" ")
    r = json.loads(payload)
    runs.setdefault((r["impl"], r["L"], r["page_size"]), {}).setdefault(tag, []).append(r["ms"])
print(f"{'case':48s} {'base ms':>10s} {'new ms':>10s} {'change':>8s}")
for (impl, length, page), by_tag in sorted(runs.items()):
    base, new = (statistics.median(by_tag.get(t, [float("nan")])) for t in ("base", "new"))
    print(f"{impl + ' L=' + str(length) + ' page=' + str(page):48s} {base:10.3f} {new:10.3f} {100 * (new / base - 1):+7.1f}%")
PY
rm -f "$LOG"
