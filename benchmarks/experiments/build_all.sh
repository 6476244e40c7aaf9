#!/usr/bin/env bash
# Builds the libraries of the device plan (README.md in this folder) into .carry/, one after the
# other (25-30 minutes on two cores; start it first thing in a session: .carry/ does not outlive the checkout):
#
#   benchmarks/experiments/build_all.sh [NAME...]
#
# NAME is one of head (the shipped tree), rowsum, treemax, both, half, zero-offset, colsums [all of them]. Each build's
# log is .carry/NAME/ptxas.log; a failed build is reported and the others still run (exit status 1 at the end).
set -uo pipefail
E="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build() {
  case "$1" in
    head) "$E/build_candidate.sh" ;;
    rowsum) "$E/build_candidate.sh" "$E/mma-row-sums.patch" -DFPV2_HOPPER_MMA_ROW_SUMS=1 ;;
    treemax) "$E/build_candidate.sh" "$E/tree-max.patch" -DFPV2_HOPPER_TREE_MAX=1 ;;
    both)
      "$E/build_candidate.sh" "$E/mma-row-sums.patch" "$E/tree-max.patch" \
        "-DFPV2_HOPPER_MMA_ROW_SUMS=1 -DFPV2_HOPPER_TREE_MAX=1"
      ;;
    half) "$E/build_candidate.sh" "$E/half-last-pooled-tile.patch" -DFPV2_HOPPER_HALF_LAST_POOLED=1 ;;
    zero-offset) "$E/build_candidate.sh" "$E/score-zero-offset.patch" ;;
    colsums) "$E/build_candidate.sh" "$E/pooled-column-sums.patch" -DFPV2_HOPPER_POOLED_COLUMN_SUMS=1 ;;
    *)
      echo "build_all: unknown library $1 (head, rowsum, treemax, both, half, zero-offset, colsums)" >&2
      return 2
      ;;
  esac
}
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(head rowsum treemax both half zero-offset colsums)
status=0
for name in "${NAMES[@]}"; do
  start=$SECONDS
  if CANDIDATE="$name" build "$name"; then
    echo "build_all: $name done in $((SECONDS - start)) s"
  else
    echo "build_all: $name FAILED"
    status=1
  fi
done
exit $status
