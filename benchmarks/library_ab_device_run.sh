#!/usr/bin/env bash
# Device run: two builds of the native library against each other on the Hopper attention kernel alone, from the
# repository root (for a kernel change prepared as a patch in benchmarks/experiments/, built on the development
# machine into CANDIDATE_BIN, with the shipped tree's build in BIN).
#
#   benchmarks/library_ab_device_run.sh speed  attention_switch_probe.py on the planted workload (page 1, alpha 0.1)
#                                              at 128K and 32K, correction off / mean / second order, one library
#                                              per process, the shipped one and the candidates alternating,
#                                              ROUNDS rounds [2]
#   benchmarks/library_ab_device_run.sh tests  the Hopper kernel's GPU suite on each candidate
#
# The prediction belongs to the experiment (benchmarks/experiments/README.md): copy it into the notes before
# the run.
#
# Environment: BIN [.carry/head]; MODES (correction modes of the speed part) [off,mean,second_order]; the
# candidates as CANDIDATES="LABEL=FOLDER ..." or one as CANDIDATE_BIN [.carry/candidate] with LABEL (the
# experiment's name) [candidate]; ROUNDS [2]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start library-ab "${1:-speed}" "${BIN:-.carry/head}"
RESULTS="$OUT"
read_candidates "${CANDIDATES:-${LABEL:-candidate}=${CANDIDATE_BIN:-.carry/candidate}}"

if [ "$PART" = speed ]; then
  attention_rounds "${ROUNDS:-2}" "${MODES:-off,mean,second_order}" attention-ab.jsonl "shipped=$BIN" "${CANDIDATE_LIST[@]}"
  attention_table attention-ab.jsonl
fi

if [ "$PART" = tests ]; then
  for candidate in "${CANDIDATE_LIST[@]}"; do
    BIN="${candidate#*=}" gpu_tests "hopper-kernel-${candidate%%=*}" 300 packages/fpv2-kernel/tests/test_hopper_kernel.py \
      -m hopper
  done
fi
