#!/usr/bin/env bash
# Host marks with a sleeping and a polling wait; the quantizer's GPU tests after the reference fix.
RET=$OUT; R=$(mktemp -d)
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')
export FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so FPV2_COMMIT=$(cat .carry/TREE_COMMIT)
python3 -c "
import torch; a = torch.rand(1 << 20, device='cuda') * 100
print('scalar / vs IEEE tensor /: differing elements', int((a / 448.0 != a / torch.full_like(a, 448.0)).sum()), 'of', a.numel())"
FPV2_REQUIRE_NATIVE=1 timeout 90 python3 -m pytest -p no:cacheprovider -q -m "gpu or hopper" packages/fpv2-kernel/tests/test_pooled_e4m3.py > $R/pytest-quantizer.log 2>&1; echo "pytest rc=$?"; tail -3 $R/pytest-quantizer.log
timeout 120 python3 benchmarks/pipeline_profile.py --marks-only --seqlen 32768 131072 --page-size 128 --repeats 10 --out $R/marks > $R/marks.log 2>&1; echo "marks rc=$?"
grep -v Warn $R/marks.log | tail -44
tar czf $RET/callC.tgz -C "$R" .
