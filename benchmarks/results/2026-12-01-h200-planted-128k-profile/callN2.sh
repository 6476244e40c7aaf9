#!/usr/bin/env bash
# Session 7, call 2: host time of each pipeline function at 32K and 128K.
RET=$OUT; R=$(mktemp -d)
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so
timeout 200 python3 benchmarks/pipeline_profile.py --seqlen 32768 131072 --repeats 100 --host-breakdown --out $R/breakdown > $R/breakdown.log 2>&1; echo "breakdown rc=$?"
cat $R/breakdown.log | grep -v "^$" | head -130
tar czf $RET/callN2.tgz -C "$R" .
