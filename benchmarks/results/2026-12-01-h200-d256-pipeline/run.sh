#!/bin/bash
# d=256 through the pipeline (fpv2 bench, auto -> Hopper; Triton at 32K), d=128 128K bench on the same library,
# then the kernel and serving packages' GPU tests.
RET=$OUT; R=$(mktemp -d)
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/d256b/libfpv2_kernel.so FPV2_COMMIT=$(cat .carry/FINAL_COMMIT)
run_bench() { local name=$1; shift; timeout 150 python3 -m fpv2.serving bench "$@" --no-progress --out $R/$name > $R/$name.log 2>&1; echo "bench $name rc=$?"; grep -E "│ fpv2-(sparse|dense)|│ torch|│ triton" $R/$name.log | cut -c1-170; }
run_bench d256-32k -B 1 -L 32768 --head-dim 256 --page-size 128 --alpha 0.1
run_bench d256-128k -B 1 -L 131072 --head-dim 256 --page-size 128 --alpha 0.1
run_bench d256-32k-triton -B 1 -L 32768 --head-dim 256 --page-size 128 --alpha 0.1 --backend triton
run_bench d128-128k -B 1 -L 131072 --page-size 128 --alpha 0.1
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or hopper" packages/fpv2-kernel/tests --junitxml=$R/pytest-gpu-kernel.xml > $R/pytest-gpu-kernel.log 2>&1; echo "pytest kernel gpu rc=$?"; tail -1 $R/pytest-gpu-kernel.log | cut -c1-200
grep -E "^FAILED|^ERROR" $R/pytest-gpu-kernel.log | head -5 | cut -c1-200
tar czf $RET/call10.tgz -C "$R" .
