#!/usr/bin/env bash
# Session 7, call 1: source-level ncu of the planted 128K corrected kernel; host profile (cProfile, 200 calls)
# and host marks at 32K/128K; the 4 x 128K bench on the committed kernel.
RET=$OUT; R=$(mktemp -d); NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt
rep=$R/planted128k
timeout 240 $NCU --clock-control none -k regex:prefill_kernel --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --import-source yes -f -o $rep python3 .carry/ncu_planted.py > $R/ncu-run.log 2>&1; echo "ncu rc=$?"
$NCU --import $rep.ncu-rep --print-details all > $R/ncu-planted128k.txt 2>&1
$NCU --import $rep.ncu-rep --page source --csv --print-source cuda,sass > $R/source-planted128k.csv 2> $R/source.err
grep -E "Elapsed Cycles|SM Active Cycles|Duration|Warp Cycles Per Issued|Compute \(SM\) Throughput" $R/ncu-planted128k.txt | head -6
rm -f $rep.ncu-rep
timeout 150 python3 benchmarks/pipeline_profile.py --seqlen 32768 131072 --repeats 200 --out $R/profile > $R/profile.log 2>&1; echo "profile rc=$?"
grep "^== " $R/profile.log
timeout 90 python3 benchmarks/pipeline_profile.py --seqlen 32768 131072 --repeats 50 --marks-only --out $R/marks > $R/marks.log 2>&1; echo "marks rc=$?"
grep -A6 "corrected, waited by synchronize" $R/marks.log | grep -v "^--"
F=$R/bench-4x128k
FPV2_COMMIT=$(cat .carry/TREE_COMMIT) timeout 200 python3 -m fpv2.serving bench -B 4 -L 131072 --page-size 128 --alpha 0.1 --no-progress --out $F > $F.log 2>&1
echo "bench 4x128K rc=$?"; grep -E "│ fpv2-(sparse|dense)|cudnn" $F.log | cut -c1-170
tar czf $RET/callN1.tgz -C "$R" .
