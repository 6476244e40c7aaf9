#!/usr/bin/env bash
# Per-CTA fixed cost of the sparse kernel (kept-fraction sweep, default vs persistent) and ncu of the
# planted pipeline's kernel at 128K in both tile orders.
RET=$OUT; R=$(mktemp -d); B=.carry/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $R/gpu.txt
for K in 0.0 0.03 0.06; do
  timeout 100 $B/fpv2_hopper_prefill_test --mode timing --lengths 32768,131072 --repeats 10 --keep $K > $R/timing-keep$K.log 2>&1
  echo "keep=$K rc=$?"; grep "^\[" $R/timing-keep$K.log | grep -E "sparse |corrected " | grep -v e4m3 | sed -E 's/ max\|err.*//' | cut -c1-170
done
FPV2_HOPPER_PERSISTENT=1 timeout 100 $B/fpv2_hopper_prefill_test --mode timing --lengths 32768,131072 --repeats 10 --keep 0.03 > $R/timing-persistent-keep0.03.log 2>&1
echo "persistent rc=$?"; grep "^\[" $R/timing-persistent-keep0.03.log | grep -E "sparse |corrected " | grep -v e4m3 | sed -E 's/ max\|err.*//' | cut -c1-170
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for HM in 1 0; do
  FPV2_HOPPER_HEAD_MAJOR=$HM timeout 150 $NCU --kernel-name regex:prefill_kernel --csv --metrics \
gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed \
    python3 .carry/ncu_planted.py > $R/ncu-planted-hm$HM.csv 2> $R/ncu-planted-hm$HM.err; echo "ncu hm=$HM rc=$?"
  grep -v "^==" $R/ncu-planted-hm$HM.csv | awk -F'","' 'NR>1 {print $1" | "$(NF-2)" | "$NF}' | sed 's/"//g' | cut -c1-120 | head -20
done
tar czf $RET/callM1.tgz -C "$R" .
