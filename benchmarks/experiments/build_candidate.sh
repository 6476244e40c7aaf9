#!/usr/bin/env bash
# Builds the native library with prepared patches applied, for a device A/B against the shipped build:
#
#   benchmarks/experiments/build_candidate.sh [PATCH...] [CUDA_FLAGS]
#
# The patches (the arguments ending in .patch; none: the shipped tree) are applied in order to a temporary
# worktree of HEAD (the checkout is not touched), the library is configured
# with the Python of $PYTHON [python3] (it needs the nvidia-cutlass headers) and CUDA_FLAGS as
# CMAKE_CUDA_FLAGS (e.g. -DFPV2_HOPPER_HALF_LAST_POOLED=1), built, and written xz-compressed to
# .carry/$CANDIDATE/libfpv2_kernel.so.xz [CANDIDATE=candidate]; the ptxas report goes to ptxas.log beside it.
# Decompress it on the device before use (the carry replaces the folder at every call).
set -euo pipefail
ROOT="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
PATCHES=()
while [ $# -gt 0 ] && [[ "$1" == *.patch ]]; do
  PATCHES+=("$(cd "$(dirname "$1")" && pwd)/$(basename "$1")")
  shift
done
if [ $# -gt 1 ]; then
  echo "usage: $0 [PATCH...] [CUDA_FLAGS]" >&2
  exit 2
fi
FLAGS="${1:-}"
OUT_DIR="$ROOT/.carry/${CANDIDATE:-candidate}"
WORK="$(mktemp -d)"
trap 'git -C "$ROOT" worktree remove --force "$WORK/tree" > /dev/null 2>&1; rm -rf "$WORK"' EXIT
git -C "$ROOT" worktree add --detach "$WORK/tree" HEAD > /dev/null
for patch in "${PATCHES[@]+"${PATCHES[@]}"}"; do
  git -C "$WORK/tree" apply "$patch"
done
cmake -S "$WORK/tree/packages/fpv2-kernel" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v "${PYTHON:-python3}")" -DCMAKE_CUDA_FLAGS="$FLAGS" > "$WORK/configure.log"
mkdir -p "$OUT_DIR"
ninja -C "$WORK/build" libfpv2_kernel.so > "$OUT_DIR/ptxas.log" 2>&1 ||
  { tail -30 "$OUT_DIR/ptxas.log"; exit 1; }
xz -T2 -6 -c "$WORK/build/libfpv2_kernel.so" > "$OUT_DIR/libfpv2_kernel.so.xz"
NAMES="${PATCHES[*]+${PATCHES[*]##*/}}"
echo "built ${NAMES:-the shipped tree}${FLAGS:+ ($FLAGS)} into ${OUT_DIR#"$ROOT"/};" \
  "instances with spills: $(grep -c '[1-9][0-9]* bytes spill stores' "$OUT_DIR/ptxas.log")"
