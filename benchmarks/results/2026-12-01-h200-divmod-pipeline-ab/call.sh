#!/usr/bin/env bash
# The planted pipeline, previous library (326cdfe) against this commit's (default one CTA per tile), in
# alternating pairs: 128K twice, 32K once.
RET=$OUT; R=$(mktemp -d)
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')
for L in 131072 32768 131072; do for V in old new; do
  if [ $V = old ]; then LIB=$PWD/.carry/bin-old/libfpv2_kernel.so; C=326cdfe; else LIB=$PWD/.carry/lib/libfpv2_kernel.so; C=$(cat .carry/TREE_COMMIT); fi
  n=$((n+1)); F=$R/bench-$L-$V-$n
  FPV2_KERNEL_LIBRARY=$LIB FPV2_COMMIT=$C timeout 90 python3 -m fpv2.serving bench -B 1 -L $L --page-size 128 --alpha 0.1 --no-progress --out $F > $F.log 2>&1
  echo "bench L=$L $V rc=$?"; grep -E "│ fpv2-(sparse|dense)" $F.log | cut -c1-160
done; done
tar czf $RET/callM8.tgz -C "$R" .
