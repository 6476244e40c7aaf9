"""A/B of the CSR compaction kernel: one segment per program against several (``launch_compact``).

Builds a real index on the planted workload (the default max-threshold selection,
one request, 32/8 heads, d 128) at each ``--seqlen``, then replays only the
compaction on the selection's keep bits and offsets with ``segments_per_program=1``
(the default) and ``FILL`` (a 4096-bit tile of several segments), alternating, CUDA events around
``--calls`` back-to-back launches; checks both write the same block ids.

Usage (the four packages' ``src`` on ``PYTHONPATH``, on a GPU):
``python benchmarks/compaction_ab.py --seqlen 32768 131072 --out OUT``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fpv2.index import SelectionConfig
from fpv2.index.triton import IndexWorkspace, pool_blocks_triton, select_blocks_triton
from fpv2.index.triton.compaction import FILL, compact_tiling, launch_compact
from fpv2.kernel.testing import planted_workload


def time_compaction(keep_bits, offsets, blocks, segments: int | None, calls: int) -> float:
    """Mean GPU microseconds of one compaction launch over ``calls`` back-to-back launches."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        launch_compact(keep_bits, offsets, blocks, segments_per_program=segments)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls


def main() -> None:
    """Time both launches at each length; print the table and write ``compaction-ab.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("fpv2-results/compaction-ab"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compaction_ab.py needs a CUDA GPU")
    records = []
    for seqlen in args.seqlen:
        wl = planted_workload(
            [seqlen],
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            page_size=args.page_size,
            dtype=torch.bfloat16,
            device=torch.device("cuda"),
        )
        config = SelectionConfig()
        stats = pool_blocks_triton(wl.k_cache, None, wl.batch, block_size=config.block_size)
        workspace = IndexWorkspace()
        index = select_blocks_triton(wl.q, wl.batch, stats, config=config, workspace=workspace, exact_nnz=True)
        keep_bits = workspace._views[1].keep_bits  # the selection's own keep bits (same shape key)
        nnz = int(index.offsets[-1])
        outputs, times = {}, {"one": [], "several": []}
        for label, segments in (("one", 1), ("several", FILL)):
            out = torch.full_like(index.blocks, -1)
            launch_compact(keep_bits, index.offsets, out, segments_per_program=segments)  # compile, then check
            outputs[label] = out[:nnz].clone()
        for _ in range(args.rounds):
            for label, segments in (("one", 1), ("several", FILL)):
                times[label].append(time_compaction(keep_bits, index.offsets, index.blocks, segments, args.calls))
        identical = torch.equal(outputs["one"], outputs["several"]) and torch.equal(outputs["one"], index.blocks[:nnz])
        bits, segs, warps = compact_tiling(keep_bits.shape[1], FILL)
        record = {
            "L": seqlen,
            "segments": index.num_segments,
            "nnz": nnz,
            "tiling": {"bits": bits, "segments_per_program": segs, "num_warps": warps},
            "us_one_per_program": sorted(times["one"])[args.rounds // 2],
            "us_several_per_program": sorted(times["several"])[args.rounds // 2],
            "samples_us": times,
            "identical": identical,
        }
        records.append(record)
        print(
            f"L={seqlen}: {index.num_segments} segments, nnz {nnz}, tiling {record['tiling']}: "
            f"one/program {record['us_one_per_program']:.1f} us, several {record['us_several_per_program']:.1f} us, "
            f"identical {identical}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compaction-ab.json").write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
