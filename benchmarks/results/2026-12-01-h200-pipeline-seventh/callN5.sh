#!/usr/bin/env bash
# Session 7, call 5: the session's end state against its start (pipeline, alternating processes), fpv2 bench
# 32K/128K, the index stage against the start's (index_speed, page 1), the kernel package's GPU tests.
RET=$OUT; R=$(mktemp -d); n=0
mkdir -p $R/src-base $R/src-final; tar xf .carry/base-src.tar -C $R/src-base; tar xf .carry/final-src.tar -C $R/src-final
for L in 131072 32768; do for V in base final final base; do
  n=$((n+1)); F=$R/pipe-$L-$V-$n.log
  if [ $V = base ]; then LIB=$PWD/.carry/base/libfpv2_kernel.so; else LIB=$PWD/.carry/lib/libfpv2_kernel.so; fi
  FPV2_KERNEL_LIBRARY=$LIB PYTHONPATH=$(ls -d $R/src-$V/packages/*/src | tr '\n' ':') timeout 90 python3 .carry/pipe_time.py $L > $F 2>&1; echo "pipe $V rc=$? $(tail -1 $F)"
done; done
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so FPV2_COMMIT=$(cat .carry/FINAL_COMMIT)
for L in 32768 131072; do
  F=$R/bench-$L; timeout 120 python3 -m fpv2.serving bench -B 1 -L $L --page-size 128 --alpha 0.1 --no-progress --out $F > $F.log 2>&1
  echo "bench L=$L rc=$?"; grep -E "│ fpv2-(sparse|dense)|│ torch" $F.log | cut -c1-170
done
timeout 150 python3 benchmarks/index_speed.py --seqlens 32768 131072 --probes --error-seqlens --no-host-profile \
  --baseline-dir $R/src-base/packages/fpv2-index/src/fpv2/index/triton --baseline-label start-of-session --out $R/index-speed > $R/index-speed.log 2>&1
echo "index_speed rc=$?"; grep -iE "index|pool|select|graph|host" $R/index-speed.log | head -30 | cut -c1-160
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or hopper" packages/fpv2-kernel/tests --junitxml=$R/pytest-gpu-kernel.xml > $R/pytest-gpu-kernel.log 2>&1; echo "pytest kernel gpu rc=$?"; tail -1 $R/pytest-gpu-kernel.log | cut -c1-200
grep -E "^FAILED|^ERROR" $R/pytest-gpu-kernel.log | head -5 | cut -c1-200
rm -rf $R/src-base $R/src-final
tar czf $RET/callN5.tgz -C "$R" .
