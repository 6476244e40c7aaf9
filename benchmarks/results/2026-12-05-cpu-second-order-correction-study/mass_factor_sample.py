"""The mass factor of a sample of blocks on the anisotropic drifting keys: true against second-order estimates.

Head 0, the last 512 queries, blocks 0, 7, ..., 98 of a 16K drifting workload (8/2 heads, d 128, seed 0)
whose keys' first 8 channels are multiplied by 4 (the study's ``--outlier-channels 8``). Prints the mean
and median over (row, block) of ``log mean_i exp(delta_i)`` (true), ``var(delta) / 2`` (exact second
order), and the diagonal and isotropic shifts (uncapped). Run from the repository root with the packages'
``src`` on ``PYTHONPATH``.
"""

import math

import torch

from fpv2.kernel.reference.paged import gather_kv
from fpv2.kernel.testing import planted_workload

w = planted_workload([16384], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=128, seed=0, drift_tokens=256.0)
k = w.k_cache.float().clone()
k[..., :8] *= 4
keys = gather_kv(k, w.batch, 0)[:, 0].double()
q = w.q.float()[-512:, 0].double()
scale = 1 / math.sqrt(128)
res = {"true": [], "exact second order": [], "diagonal": [], "isotropic": []}
for block in range(0, 100, 7):
    tokens = keys[block * 128 : (block + 1) * 128]
    mean = tokens.mean(0)
    delta = (q @ (tokens - mean).T) * scale
    res["true"].append(torch.logsumexp(delta, 1) - math.log(128))
    res["exact second order"].append(0.5 * delta.var(1, unbiased=False))
    channel_var = tokens.var(0, unbiased=False)
    res["diagonal"].append(0.5 * scale**2 * (q**2 @ channel_var))
    res["isotropic"].append(0.5 * scale**2 * (q**2).sum(1) * channel_var.mean())
for name, values in res.items():
    values = torch.cat(values)
    print(f"{name}: mean {float(values.mean()):.3f}, median {float(values.median()):.3f}")
