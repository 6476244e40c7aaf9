#!/usr/bin/env bash
# Where the sparse kernel's time goes: DRAM / L2 traffic of dense, sparse, corrected and e4m3-corrected at 128K.
RET=$OUT; R=$(mktemp -d); B=.carry/bin
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 400 $NCU --kernel-name regex:prefill_kernel --launch-skip 1 --launch-count 7 --csv --metrics \
gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
  $B/prefill_test_after --mode timing --lengths 131072 --repeats 1 > $R/ncu-128k.csv 2> $R/ncu-128k.err; echo "ncu rc=$?"
grep -v "^==" $R/ncu-128k.csv | awk -F'","' 'NR>1 {print $1" | "$5" | "$(NF-2)" | "$NF}' | sed 's/"//g' | cut -c1-200 | head -70
tail -3 $R/ncu-128k.err
tar czf $RET/callF.tgz -C "$R" .
