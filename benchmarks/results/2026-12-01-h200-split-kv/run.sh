#!/bin/bash
# Split-KV with the one-wave count: hang check, the grid (automatic splits), chunk timings with and without
# splits, the binding's tests, the serving GPU tests and a 32K pipeline bench on the final library.
RET=$OUT; R=$(mktemp -d); N=.carry/split/fpv2_hopper_prefill_test
short() { grep "^\[PASS\]\|^\[FAIL\]" $1 | sed -E 's/^\[([A-Z]+)\].*L=([0-9]+) Q=([0-9]+).* d=([0-9]+).*(fpv2-hopper-[a-z0-9-]+) +density ([0-9.]+): median ([0-9.]+) ms.*/\1 L=\2 Q=\3 d=\4 \5 \6 \7/'; }
timeout 60 $N --mode small > $R/small.log 2>&1; echo "small rc=$?"
FPV2_HOPPER_SPLITS=5 timeout 60 $N --mode small > $R/small-split5.log 2>&1; echo "small split5 rc=$? $(tail -1 $R/small-split5.log)"
timeout 200 $N --mode correctness --seed 21 > $R/correctness.log 2>&1; echo "grid rc=$? $(tail -1 $R/correctness.log)"
for Q in 128 256 512; do for S in 1 auto; do
  if [ $S = auto ]; then unset FPV2_HOPPER_SPLITS; else export FPV2_HOPPER_SPLITS=$S; fi
  timeout 60 $N --mode timing --lengths 131072 --query-len $Q --keep 0.03 --repeats 20 > $R/chunk-q$Q-s$S.log 2>&1; echo "chunk Q=$Q splits=$S rc=$? ws=$(grep -o '"workspace_bytes": [0-9]*' $R/chunk-q$Q-s$S.log | head -1)"; short $R/chunk-q$Q-s$S.log
done; done; unset FPV2_HOPPER_SPLITS
for S in 1 auto; do if [ $S = auto ]; then unset FPV2_HOPPER_SPLITS; else export FPV2_HOPPER_SPLITS=$S; fi
  timeout 60 $N --mode timing --head-dim 256 --lengths 131072 --query-len 256 --keep 0.03 --repeats 20 > $R/chunk-d256-q256-s$S.log 2>&1; echo "d256 Q=256 splits=$S rc=$?"; short $R/chunk-d256-q256-s$S.log; done; unset FPV2_HOPPER_SPLITS
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/split/libfpv2_kernel.so FPV2_COMMIT=$(cat .carry/FINAL_COMMIT)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or hopper" packages/fpv2-kernel/tests/test_hopper_kernel.py packages/fpv2-kernel/tests/test_native_batch_struct.py > $R/pytest-hopper.log 2>&1; echo "pytest hopper rc=$?"; tail -1 $R/pytest-hopper.log | cut -c1-200; grep -E "^FAILED|^ERROR|Error" $R/pytest-hopper.log | head -5 | cut -c1-250
timeout 90 python3 -m fpv2.serving bench -B 1 -L 32768 --page-size 128 --alpha 0.1 --no-progress --out $R/bench-32768 > $R/bench-32768.log 2>&1; echo "bench 32K rc=$?"; grep -E "│ fpv2-(sparse|dense)" $R/bench-32768.log | cut -c1-170
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or hopper" packages/fpv2-serving/tests --junitxml=$R/pytest-gpu-serving.xml > $R/pytest-gpu-serving.log 2>&1; echo "pytest serving gpu rc=$?"; tail -1 $R/pytest-gpu-serving.log | cut -c1-200; grep -E "^FAILED|^ERROR" $R/pytest-gpu-serving.log | head -5 | cut -c1-200
tar czf $RET/call12.tgz -C "$R" .
