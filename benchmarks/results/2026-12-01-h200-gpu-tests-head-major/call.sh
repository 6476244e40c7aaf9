#!/usr/bin/env bash
# The head-major default: hang check, one timing run, the kernel package's GPU tests.
RET=$OUT; R=$(mktemp -d); B=.carry/bin
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')
export FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so
timeout 60 $B/fpv2_hopper_prefill_test --mode small > $R/small.log 2>&1; rc=$?; echo "small rc=$rc"; tail -1 $R/small.log
if [ $rc -ne 0 ]; then tar czf $RET/callI.tgz -C "$R" .; exit 1; fi
timeout 60 $B/fpv2_hopper_prefill_test --mode timing --lengths 32768 --repeats 10 > $R/timing.log 2>&1; echo "timing rc=$?"
grep '^RESULT' $R/timing.log | cut -c1-200
FPV2_REQUIRE_NATIVE=1 timeout 220 python3 -m pytest -p no:cacheprovider -q -m "gpu or hopper" packages/fpv2-kernel/tests > $R/pytest-kernel.log 2>&1; echo "pytest rc=$?"; tail -2 $R/pytest-kernel.log
tar czf $RET/callI.tgz -C "$R" .
