#!/usr/bin/env bash
# Host marks at 32K before/after the binding's host trims (tensor_desc, the library lookup cached).
RET=$OUT; R=$(mktemp -d)
export FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so
for V in old new old new; do
  if [ $V = old ]; then SRC=$PWD/.carry/old-src; else SRC=$PWD; fi
  PYTHONPATH=$(ls -d $SRC/packages/*/src | tr '\n' ':') timeout 80 python3 benchmarks/pipeline_profile.py --marks-only --seqlen 32768 --page-size 128 --repeats 20 --out $R/marks-$V > $R/marks-$V-$((n=n+1)).log 2>&1; echo "$V rc=$?"
  grep -A6 "corrected, waited by synchronize" $R/marks-$V-$n.log | tail -6
done
tar czf $RET/callJ.tgz -C "$R" .
