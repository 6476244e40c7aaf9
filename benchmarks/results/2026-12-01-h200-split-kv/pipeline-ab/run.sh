#!/bin/bash
# The default path's pipeline before and after split-KV (library and Python together), alternating processes.
RET=$OUT; R=$(mktemp -d); mkdir -p $R/src-pre $R/src-split
tar xf .carry/pre-split-src.tar -C $R/src-pre; tar xf .carry/split-src.tar -C $R/src-split
n=0; for L in 32768 131072; do for V in pre split split pre; do n=$((n+1)); F=$R/pipe-$L-$V-$n.log
  if [ $V = pre ]; then LIB=$PWD/.carry/d256b/libfpv2_kernel.so; else LIB=$PWD/.carry/split/libfpv2_kernel.so; fi
  FPV2_KERNEL_LIBRARY=$LIB PYTHONPATH=$(ls -d $R/src-$V/packages/*/src | tr '\n' ':') timeout 90 python3 .carry/pipe_time.py $L > $F 2>&1; echo "pipe L=$L $V rc=$? $(tail -1 $F)"
done; done
rm -rf $R/src-pre $R/src-split; tar czf $RET/call13.tgz -C "$R" .
