"""Profile and tune the Triton attention kernel on a GPU: correction cost split and dense-mode launch parameters.

Sparse part (default L = 128K): one planted workload, one block index and one set of
pooled statistics from the pipeline (max_threshold, alpha 0.1), then the attention
kernel alone is timed under several variants on those same inputs:

- the kernel as it was before this work (``--baseline``: the module
  ``fpv2.kernel.triton_baseline``, a copy of the old kernel with a profiling knob,
  carried to the device and not committed): no correction; correction with the
  in-kernel CSR scan; with todo words precomputed; correction without its PV update;
  only the todo derivation (no correction math);
- the current kernel: no correction, its table configuration, and the launch
  overrides named below (correction step, pipelining depth, grid order), plus the
  same with todo words handed in (so the word-building kernel's cost shows).

Every sparse output is compared with the kernel's own dense mode on the same inputs
(``rel_err``; the dense mode itself is 0.0021 from fp32 at 128K, measured earlier).

Dense part (default L = 32K): the kernel's dense mode (``index=None``) under launch
overrides, and the old kernel's dense mode. Then the whole pipeline (index /
correction plan / attention stage split) at the sparse length, with and without the
correction.

Variants compile in parallel worker processes on a small input first (Triton's
on-disk cache then serves the timed process). Timings: CUDA events, median of
``--repeats`` runs after ``--warmup`` (``fpv2.serving.timing``).

Usage (from the repository root, the four packages' ``src`` on ``PYTHONPATH``):
``python benchmarks/triton_attention_profile.py --device cuda:0 --out OUT [--baseline]``
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import multiprocessing as mp
import platform
import time
from pathlib import Path

import torch

SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1)
COMPILE_L = 8192

#: Launch overrides of the current kernel, applied on top of its tuning table entry.
SPARSE_NEW = {
    "table": {},
    "step64_stages1": dict(correction_step=64, correction_stages=1),
    "step64_stages3": dict(correction_step=64, correction_stages=3),
    "step128_stages2": dict(correction_step=128, correction_stages=2),
    "step32_stages2": dict(correction_step=32, correction_stages=2),
    "segment_order": dict(reverse_grid=False),
}
#: Profiling parts of the old kernel (its CORR_PART knob): 0 full, 1 no PV update, 2 todo words only.
SPARSE_OLD = {
    "scan_split": ("derive", 0),
    "words_split": ("words", 0),
    "scan_split_noPV": ("derive", 1),
    "scan_todo_only": ("derive", 2),
}
DENSE_NEW = {
    "n128_w8_s3": dict(block_n=128, num_warps=8, num_stages=3),
    "n128_w8_s2": dict(block_n=128, num_warps=8, num_stages=2),
    "n128_w8_s3_segment_order": dict(block_n=128, num_warps=8, num_stages=3, reverse_grid=False),
    "n64_w8_s3": dict(block_n=64, num_warps=8, num_stages=3),
    "n64_w8_s4": dict(block_n=64, num_warps=8, num_stages=4),
    "n64_w4_s3": dict(block_n=64, num_warps=4, num_stages=3),
}


def variants(baseline: bool) -> list[dict]:
    """Every kernel call to time, as plain dicts (they travel to the compile workers)."""
    out = [dict(name="new/none", module="new", mode="sparse", plan=None, launch=None)]
    for name, over in SPARSE_NEW.items():
        out.append(dict(name=f"new/{name}", module="new", mode="sparse", plan="derive", launch=over))
    out.append(dict(name="new/table_words_given", module="new", mode="sparse", plan="words", launch={}))
    for name, over in DENSE_NEW.items():
        out.append(dict(name=f"new/dense_{name}", module="new", mode="dense", plan=None, launch=over))
    if baseline:
        out.append(dict(name="old/none", module="old", mode="sparse", plan=None))
        for name, (plan, part) in SPARSE_OLD.items():
            out.append(dict(name=f"old/{name}", module="old", mode="sparse", plan=plan, corr_part=part))
        out.append(dict(name="old/dense_n128_w8_s3", module="old", mode="dense", plan=None))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _module(name: str):
    return importlib.import_module("fpv2.kernel.triton" if name == "new" else "fpv2.kernel.triton_baseline")


class Inputs:
    """One planted workload with its index, statistics and plans (built through the pipeline)."""

    def __init__(self, seqlen: int, device: torch.device, sparse: bool = True) -> None:
        from fpv2.index import SelectionConfig
        from fpv2.kernel import CorrectionPlan
        from fpv2.kernel.testing.workloads import planted_workload
        from fpv2.kernel.triton.todo_words import todo_words
        from fpv2.serving.pipeline import SparsePrefillPipeline

        self.seqlen = seqlen
        self.wl = planted_workload([seqlen], device=device, dtype=torch.bfloat16, seed=0, **SHAPE)
        self.index = self.stats = None
        self.plans: dict[str, object] = {}
        if sparse:
            pipe = SparsePrefillPipeline(SelectionConfig(alpha=0.1), correction=True, backend="triton")
            result = pipe(self.wl.q, self.wl.k_cache, self.wl.v_cache, self.wl.batch)
            self.index, self.stats = result.index, result.statistics
            offsets, words = todo_words(self.index, self.wl.batch)
            self.plans = {
                "derive": CorrectionPlan(self.stats),
                "words": CorrectionPlan(self.stats, offsets, words),
            }

    def call(self, v: dict):
        """A zero-argument callable running variant ``v`` on these inputs."""
        mod = _module(v["module"])
        wl = self.wl
        kwargs: dict[str, object] = {}
        if v["module"] == "new" and v.get("launch") is not None:
            base = mod.launch_config(SHAPE["head_dim"], 128)
            kwargs["launch"] = dataclasses.replace(base, **v["launch"])
        if v["module"] == "old" and v.get("corr_part"):
            kwargs["corr_part"] = v["corr_part"]
        index = None if v["mode"] == "dense" else self.index
        plan = self.plans[v["plan"]] if v.get("plan") else None
        return lambda: mod.sparse_attention_triton(wl.q, wl.k_cache, wl.v_cache, wl.batch, index, plan=plan, **kwargs)


def _compile_worker(args: tuple[str, list[dict]]) -> list[tuple[str, float, str]]:
    """Run each variant once on a small input so its kernels land in Triton's on-disk cache."""
    device_name, chunk = args
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    inputs = Inputs(COMPILE_L if device.type == "cuda" else 256, device)
    done = []
    for v in chunk:
        t0 = time.perf_counter()
        try:
            inputs.call(v)()
            _sync(device)
            done.append((v["name"], time.perf_counter() - t0, "ok"))
        except Exception as exc:  # reported, the timed pass skips it
            done.append((v["name"], time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:300]))
    return done


def main() -> None:
    from fpv2.serving.environment import git_commit, gpu_name
    from fpv2.serving.metrics import dense_causal_flops, relative_l2_error
    from fpv2.serving.pipeline import SparsePrefillPipeline
    from fpv2.serving.timing import benchmark_device, median, timed_samples

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", default="fpv2-results/triton-profile")
    parser.add_argument("--sparse-len", type=int, default=131072)
    parser.add_argument("--dense-len", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--baseline", action="store_true", help="also time fpv2.kernel.triton_baseline")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    args = parser.parse_args()

    start = time.perf_counter()
    device = benchmark_device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = variants(args.baseline)
    if args.only:
        keep = set(args.only.split(","))
        todo = [v for v in todo if v["name"] in keep]
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)  # noqa: E731

    chunks = [todo[i :: args.workers] for i in range(args.workers)]
    pool = mp.get_context("spawn").Pool(args.workers)
    pending = pool.map_async(_compile_worker, [(str(device), c) for c in chunks if c])
    log(f"compiling {len(todo)} variants in {args.workers} workers; building the {args.sparse_len} workload")
    sparse = Inputs(args.sparse_len, device)
    _sync(device)
    log(f"sparse inputs ready: density {sparse.index.density(sparse.wl.batch):.4f}")
    compile_report = [row for rows in pending.get() for row in rows]
    pool.close()
    failed = {name: why for name, _, why in compile_report if why != "ok"}
    log(f"compiled; slowest {max((s for _, s, _ in compile_report), default=0):.1f}s; failed: {failed or 'none'}")

    records: list[dict] = []
    path = out_dir / "triton_profile.json"

    def dump(**extra: object) -> dict:
        """Write what is measured so far (a run stopped at its time limit keeps its rows)."""
        summary = dict(
            what="Triton attention kernel profile: correction cost split, launch-parameter sweep, pipeline stage split",
            commit=git_commit(),
            gpu=gpu_name(device),
            torch=torch.__version__,
            triton=importlib.import_module("triton").__version__,
            python=platform.python_version(),
            shape=dict(B=1, **SHAPE, dtype="bf16", workload="planted (fraction 0.02, margin 7, seed 0)", alpha=0.1),
            timer=f"cuda-events, median of {args.repeats} after {args.warmup} warm-up",
            reference="rel_err of sparse rows: vs the kernel's dense mode on the same inputs; dense rows: vs the "
            "first dense variant",
            compile=[dict(name=n, seconds=round(s, 1), status=w) for n, s, w in compile_report],
            records=records,
            wall_s=round(time.perf_counter() - start, 1),
            **extra,
        )
        path.write_text(json.dumps(summary, indent=1))
        return summary

    def time_variant(inputs: Inputs, v: dict, ref: torch.Tensor | None) -> torch.Tensor | None:
        if v["name"] in failed:
            records.append(dict(name=v["name"], L=inputs.seqlen, error=failed[v["name"]]))
            return None
        try:
            samples, result = timed_samples(inputs.call(v), args.warmup, args.repeats, device)
        except Exception as exc:
            records.append(dict(name=v["name"], L=inputs.seqlen, error=f"{type(exc).__name__}: {exc}"[:300]))
            log(f"{v['name']}: FAILED {exc}")
            return None
        flops = dense_causal_flops([inputs.seqlen], [inputs.seqlen], SHAPE["num_q_heads"], SHAPE["head_dim"])
        ms = median(samples)
        rec = dict(
            name=v["name"],
            L=inputs.seqlen,
            mode=v["mode"],
            plan=v.get("plan"),
            ms=round(ms, 4),
            ms_min=round(min(samples), 4),
            samples_ms=[round(x, 4) for x in samples],
            dense_equiv_tflops=round(flops / ms / 1e9, 1),
        )
        if ref is not None:
            rec["rel_err"] = round(relative_l2_error(result, ref), 5)
        records.append(rec)
        dump()
        log(f"{v['name']:<34} {ms:8.3f} ms {rec.get('rel_err', '')}")
        return result

    # ---- sparse variants at the long length; reference: the current kernel's dense mode
    ref = sparse.call(dict(module="new", mode="dense", launch=None))()
    base_out = None
    for v in sorted((v for v in todo if v["mode"] == "sparse"), key=lambda v: v["module"] != "old"):
        out = time_variant(sparse, v, ref)
        if v["name"] == "old/scan_split":
            base_out = out
        elif v["name"] == "new/table" and base_out is not None and out is not None:
            records[-1]["rel_diff_vs_old_scan_split"] = round(relative_l2_error(out, base_out), 6)
        del out
    del base_out

    # ---- whole pipeline at the long length: stage split
    from fpv2.index import SelectionConfig

    wl = sparse.wl
    for correction in (True, False):
        pipe = SparsePrefillPipeline(SelectionConfig(alpha=0.1), correction=correction, backend="triton")
        stages = []

        def collect(result, timed, stages=stages):
            if timed:
                stages.append(result.timings)

        samples, result = timed_samples(
            lambda pipe=pipe, wl=wl: pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch),
            args.warmup,
            args.repeats,
            device,
            on_call=collect,
        )
        rec = dict(
            name=f"pipeline/{'correction' if correction else 'no_correction'}",
            L=sparse.seqlen,
            ms=round(median(samples), 4),
            index_ms=round(median([s.index_ms for s in stages]), 4),
            correction_ms=round(median([s.correction_ms for s in stages]), 4),
            attention_ms=round(median([s.attention_ms for s in stages]), 4),
            rel_err=round(relative_l2_error(result.out, ref), 5),
            density=round(result.index.density(wl.batch), 5),
        )
        records.append(rec)
        log(f"{rec['name']:<34} {rec['ms']:8.3f} ms (index {rec['index_ms']}, attention {rec['attention_ms']})")
        del result
    del ref, sparse, wl
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # ---- dense mode at the dense length
    dense = Inputs(args.dense_len, device, sparse=False)
    _sync(device)
    dense_ref = None
    for v in [v for v in todo if v["mode"] == "dense"]:
        out = time_variant(dense, v, dense_ref)
        if dense_ref is None and out is not None:
            dense_ref = out  # later dense variants must agree with the first
        del out

    summary = dump(complete=True)
    print(f"\n{'variant':<36} {'L':>7} {'ms':>9} {'TFLOP/s':>8} {'rel_err':>8}")
    for r in records:
        if "error" in r:
            print(f"{r['name']:<36} {r['L']:>7} ERROR {r['error'][:60]}")
            continue
        tflops, err = r.get("dense_equiv_tflops", ""), r.get("rel_err", "")
        print(f"{r['name']:<36} {r['L']:>7} {r['ms']:>9.3f} {tflops:>8} {err:>8}")
    print(f"wrote {path} ({summary['wall_s']} s)")


if __name__ == "__main__":
    main()
