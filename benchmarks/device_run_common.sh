# Shared start of the device scripts (sourced, not run): device_run_start NAME PART BIN sets ROOT (and cd's there),
# PART, BIN, OUT (default fpv2-results/NAME) and LOGS (a temporary folder packed into $OUT/NAME-PART.tgz on exit,
# also when the call's time limit stops the script part-way); with_packages runs a command with the packages'
# sources and the library in $BIN (nothing of the project is installed on the device); bench_row runs one fpv2 bench
# row of the planted pipeline into $RESULTS (set by the script); gpu_tests runs pytest into $LOGS; summary reads a
# native timing log; host_breakdown_128k runs the host breakdown of a 128K call; with_clocks samples the GPU's clock
# while a command runs; read_candidates, attention_rounds and attention_table drive library A/Bs; sparse_rows_table
# prints the sparse pipeline rows of the bench JSONs under $RESULTS.
device_run_start() {
  ROOT="$(cd "$(dirname "${BASH_SOURCE[1]}")/.." && pwd)"
  cd "$ROOT" || exit 1
  PART="$2"
  BIN="$3"
  OUT="${OUT:-$ROOT/fpv2-results/$1}"
  mkdir -p "$OUT" || exit 1
  LOGS="$(mktemp -d)"
  # shellcheck disable=SC2064  # the archive's name is fixed now
  trap "tar czf '$OUT/$1-$PART.tgz' -C '$LOGS' ." EXIT
  trap 'exit 143' TERM INT
  # A missing library is not an error for Triton-only parts, but `auto` rows would quietly run on Triton.
  if [ ! -f "$ROOT/$BIN/libfpv2_kernel.so" ]; then
    echo "device_run_start: WARNING: no libfpv2_kernel.so in $BIN (decompress the carried .xz first?): the Hopper" \
      "backend is unavailable and auto rows run on Triton"
  fi
}

with_packages() {
  # SRC_TREE: a folder holding another packages/ tree (e.g. a commit's, for an A/B of Python code); default the repo's.
  PYTHONPATH="$(ls -d "${SRC_TREE:-$ROOT}"/packages/*/src | tr '\n' ':')" FPV2_KERNEL_LIBRARY="$ROOT/$BIN/libfpv2_kernel.so" \
    "$@"
}

# fpv2 bench of the planted pipeline (alpha 0.1, page 128) into $RESULTS/NAME, log in $LOGS; further bench options
# follow LIMIT and win over these (the last --page-size counts): bench_row B L NAME LIMIT [OPTION...]
bench_row() {
  local batch="$1" length="$2" name="$3" limit="$4"
  shift 4
  with_packages timeout "$limit" python3 -m fpv2.serving bench -B "$batch" -L "$length" --page-size 128 --alpha 0.1 \
    --no-progress --out "$RESULTS/$name" "$@" > "$LOGS/$name.log" 2>&1
  echo "bench B=$batch L=$length $*: rc=$?"
  grep -E "fpv2-|torch-" "$LOGS/$name.log" | cut -c1-170
}

# The dense / sparse / corrected lines of a fpv2_hopper_prefill_test timing log: summary LOG
summary() {
  grep "^\[" "$1" | grep -E "sparse |corrected |dense " | sed -E 's/ max\|err.*//; s/.*bf16 causal //; s/over 10 runs//' |
    cut -c1-120
}

# GPU tests into $LOGS/pytest-NAME.log, the summary line and the failures printed: gpu_tests NAME LIMIT PYTEST_ARG...
gpu_tests() {
  local name="$1" limit="$2"
  shift 2
  with_packages timeout "$limit" python3 -m pytest -p no:cacheprovider -q "$@" > "$LOGS/pytest-$name.log" 2>&1
  echo "GPU tests ($name): rc=$? $(tail -1 "$LOGS/pytest-$name.log")"
  grep -E "^FAILED|^E " "$LOGS/pytest-$name.log" | head -20 | cut -c1-300
}

# pipeline_profile.py --host-breakdown of one 128K call (page 1, Hopper backend) into $RESULTS/NAME (its JSON) and
# $RESULTS/NAME-131072.txt, the rows matching PATTERN printed: host_breakdown_128k NAME PATTERN
host_breakdown_128k() {
  with_packages timeout 150 python3 benchmarks/pipeline_profile.py --seqlen 131072 --page-size 1 --backend hopper \
    --host-breakdown --repeats 30 --out "$RESULTS/$1" > "$RESULTS/$1-131072.txt" 2>&1
  echo "host breakdown: rc=$?"
  grep -E "==|whole call|$2" "$RESULTS/$1-131072.txt" | cut -c1-120
}

# Sample the GPU's SM clock, power and throttle reasons every 100 ms into $RESULTS/clocks-NAME.csv while a command
# runs, then print the most frequent clocks: with_clocks NAME COMMAND...
with_clocks() {
  local name="$1"
  shift
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > "$RESULTS/clocks-$name.csv" 2>&1 &
  local sampler=$!
  "$@"
  kill "$sampler" 2> /dev/null
  wait "$sampler" 2> /dev/null
  echo "clocks ($name): $(tail -n +2 "$RESULTS/clocks-$name.csv" | awk -F', ' '{print $2}' | sort -n | uniq -c |
    sort -rn | head -4 | tr '\n' ';')"
}

# CANDIDATE_LIST from a list "LABEL=FOLDER ...", every FOLDER checked for its libfpv2_kernel.so (a missing one
# ends the script: its rows would time nothing): read_candidates LIST
read_candidates() {
  read -r -a CANDIDATE_LIST <<< "$1"
  local candidate
  for candidate in "${CANDIDATE_LIST[@]}"; do
    if [ ! -f "$ROOT/${candidate#*=}/libfpv2_kernel.so" ]; then
      echo "read_candidates: no libfpv2_kernel.so in ${candidate#*=} (decompress the carried .xz first?)"
      exit 1
    fi
  done
}

# The Hopper attention kernel alone (attention_switch_probe.py, planted, page 1) with the library in FOLDER, its
# JSON line appended to $RESULTS/FILE: attention_probe LABEL FOLDER SEQLEN MODES FILE. The switch named is one the
# launcher reads, at its default value, so that processes with different libraries time the same launch.
attention_probe() {
  BIN="$2" with_packages timeout 120 python3 benchmarks/attention_switch_probe.py \
    --switch FPV2_HOPPER_POOLED_HALF_EXP --settings 0 --seqlen "$3" --modes "$4" --rounds 6 --calls 3 --label "$1" \
    >> "$RESULTS/$5" 2> "$LOGS/attention-$1-$3.log"
  echo "attention $1 $3: rc=$?"
}

# ROUNDS rounds of attention_probe at 128K and 32K, the libraries LABEL=FOLDER alternating within each round:
# attention_rounds ROUNDS MODES FILE LABEL=FOLDER...
attention_rounds() {
  local rounds="$1" modes="$2" file="$3"
  shift 3
  for round in $(seq "$rounds"); do
    for seqlen in 131072 32768; do
      for library in "$@"; do
        attention_probe "${library%%=*}" "${library#*=}" "$seqlen" "$modes" "$file"
      done
    done
    echo "round $round done"
  done
}

# The median and minimum lines of attention_probe's JSON file: attention_table FILE
attention_table() {
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["label"], r["seqlen"], r["mode"], r["median_ms"], r["min_ms"])
' "$RESULTS/$1"
}

# The sparse pipeline rows of the fpv2 bench JSONs under $RESULTS (one folder a row, as bench_row writes them): the
# GPU, eager and host-ahead milliseconds, the host-ahead index and attention stages and the error: sparse_rows_table
sparse_rows_table() {
  python3 - "$RESULTS" <<'EOF'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*/bench-*.json")):
    for r in json.loads(path.read_text())["rows"]:
        if r["impl"].startswith("fpv2-sparse"):
            stages = [r.get(key) for key in ("gpu_ms", "gpu_index_ms", "gpu_attention_ms")]
            gpu_ms, index_ms, attention_ms = (None if v is None else round(v, 3) for v in stages)
            print(path.parent.name, r["gpu"], "ms", round(r["ms"], 3), "gpu_ms", gpu_ms, "index", index_ms,
                  "attn", attention_ms, "err", round(r["rel_err"], 4))
EOF
}
