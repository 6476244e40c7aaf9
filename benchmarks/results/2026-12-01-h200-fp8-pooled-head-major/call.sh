#!/usr/bin/env bash
# e4m3 pooled products on the pipeline under the head-major default, 128K.
RET=$OUT; R=$(mktemp -d)
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')
export FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so FPV2_COMMIT=$(cat .carry/TREE_COMMIT)
for E in 1 0; do
  FPV2_HOPPER_POOLED_E4M3=$E timeout 80 python3 -m fpv2.serving bench -B 1 -L 131072 --page-size 128 --alpha 0.1 --no-progress --out $R/bench-e4m3-$E > $R/bench-e4m3-$E.log 2>&1
  echo "e4m3=$E rc=$?"; grep "│ fpv2-sparse" $R/bench-e4m3-$E.log | cut -c1-150
done
tar czf $RET/callK.tgz -C "$R" .
