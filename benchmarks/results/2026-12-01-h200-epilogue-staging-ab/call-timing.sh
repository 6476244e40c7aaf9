#!/usr/bin/env bash
# Epilogue through shared memory + precomputed divisions: alternating timing against the previous binary.
RET=$OUT; R=$(mktemp -d); B=.carry/bin; O=.carry/bin-old; n=0
for K in 0.0 0.03; do for V in old new new old; do
  if [ $V = old ]; then BIN=$O; else BIN=$B; fi
  n=$((n+1)); F=$R/timing-$V-keep$K-$n.log
  timeout 100 $BIN/fpv2_hopper_prefill_test --mode timing --lengths 32768,131072 --repeats 10 --keep $K > $F 2>&1
  echo "$V keep=$K rc=$?"; grep "^\[" $F | grep -E "sparse |corrected |dense " | sed -E 's/ max\|err.*//; s/.*d=128 page=128 bf16 causal //; s/over 10 runs//' | cut -c1-100
done; done
tar czf $RET/callM4.tgz -C "$R" .
