#!/usr/bin/env bash
# This commit's library: compute-sanitizer memcheck (default, persistent) and racecheck (default,
# persistent) on --mode small, then the kernel package's GPU tests.
RET=$OUT; R=$(mktemp -d); B=.carry/bin
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout 120 $SAN --tool memcheck --error-exitcode 3 $B/fpv2_hopper_prefill_test --mode small > $R/memcheck-default.log 2>&1; echo "memcheck default rc=$? $(tail -1 $R/memcheck-default.log)"
FPV2_HOPPER_PERSISTENT=1 timeout 120 $SAN --tool memcheck --error-exitcode 3 $B/fpv2_hopper_prefill_test --mode small > $R/memcheck-persistent.log 2>&1; echo "memcheck persistent rc=$? (1 = the e4m3 refusal) $(grep -c '^\[PASS' $R/memcheck-persistent.log) pass; $(tail -1 $R/memcheck-persistent.log)"
timeout 150 $SAN --tool racecheck --racecheck-report all $B/fpv2_hopper_prefill_test --mode small > $R/racecheck-default.log 2>&1; echo "racecheck default rc=$? $(grep -E 'RACECHECK SUMMARY|hazard' $R/racecheck-default.log | tail -2)"
FPV2_HOPPER_PERSISTENT=1 timeout 150 $SAN --tool racecheck --racecheck-report all $B/fpv2_hopper_prefill_test --mode small > $R/racecheck-persistent.log 2>&1; echo "racecheck persistent rc=$? $(grep -E 'RACECHECK SUMMARY|hazard' $R/racecheck-persistent.log | tail -2)"
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so
timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu packages/fpv2-kernel/tests --junitxml=$R/pytest-gpu-kernel.xml > $R/pytest-gpu-kernel.log 2>&1; echo "pytest kernel gpu rc=$?"; tail -2 $R/pytest-gpu-kernel.log
tar czf $RET/callM9.tgz -C "$R" .
