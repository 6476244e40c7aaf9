#!/bin/bash
# The index scoring kernel's knobs at d = 256 (128K, planted, page 1): which tile shape and depth.
RET=$OUT
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':'):$PWD/benchmarks FPV2_KERNEL_LIBRARY=$PWD/.carry/split/libfpv2_kernel.so
timeout 280 python3 benchmarks/index_scoring_sweep.py --seqlens 131072 --head-dim 256 --repeats 10 --no-profile \
  --variants default exact exact+bn128 exact+bn128+w8 exact+stages3 exact+qprefetch exact+prefetch \
  --out $RET/sweep > $RET/sweep.log 2>&1; echo "sweep rc=$?"; tail -25 $RET/sweep.log | cut -c1-200
