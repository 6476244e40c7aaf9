"""Profile and tune the Triton attention kernel on a GPU: correction cost, launch parameters, pipeline split.

Sparse part (default L = 128K): one planted workload, one block index and one set of
pooled statistics from the pipeline (max_threshold, alpha 0.1), then the attention
kernel alone is timed under several variants on those same inputs:

- the kernel as it was before this work (``--baseline``: the module
  ``fpv2.kernel.triton_baseline``, a copy of the old kernel with a profiling knob
  ``corr_part``, carried to the device and not committed): no correction, and the
  correction with its in-kernel CSR scan (the profile of that kernel, with todo
  words precomputed, without the PV update and with the todo derivation alone, was
  run from this script at commit 5deeae5);
- the current kernel with and without the correction: its tuning table's
  configuration and the full launch configurations listed below, plus the table
  with todo words handed in (so the word-building kernel's cost shows).

Every sparse output is compared with the kernel's own dense mode on the same inputs
(``rel_err``; the dense mode itself is 0.0021 from fp32 at 128K, measured earlier).

Dense part (default L = 32K): the dense mode (``index=None``) in bf16 and e4m3 under
the launch configurations below (``rel_err`` against the first, bf16 row), and the
old kernel's dense mode. The whole pipeline (index / correction plan / attention
stage split) runs at both lengths, with and without the correction.

Variants compile in parallel worker processes on a small input first (Triton's
on-disk cache then serves the timed process). Timings: CUDA events, median of
``--repeats`` runs after ``--warmup`` (``fpv2.serving.timing``). ``--wait-file``
holds the timing back until another job on the GPU (tests) has finished.

Usage (from the repository root, the four packages' ``src`` on ``PYTHONPATH``):
``python benchmarks/triton_attention_profile.py --device cuda:0 --out OUT [--baseline]``
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import platform
import time
from pathlib import Path

import torch

SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1)
COMPILE_L = 8192


def cfg(block_n: int, warps: int, stages: int, step: int = 64, corr_stages: int = 1, reverse: bool = True) -> dict:
    """A full launch configuration of the current kernel (the fields of ``LaunchConfig``)."""
    return dict(
        block_n=block_n,
        num_warps=warps,
        num_stages=stages,
        correction_step=step,
        correction_stages=corr_stages,
        reverse_grid=reverse,
    )


#: Current kernel, sparse with correction: launch configurations (None: the tuning table's).
CORRECTION_NEW = {
    "table": None,
    "n128w8s3_step64_cs2": cfg(128, 8, 3, 64, 2),
    "n32w4s3_step32_cs2": cfg(32, 4, 3, 32, 2),
    "n32w4s3_step32_cs1": cfg(32, 4, 3, 32, 1),
    "n32w4s3_step16_cs2": cfg(32, 4, 3, 16, 2),
}
#: Current kernel, sparse without correction.
SPARSE_NEW = {
    "table": None,
    "n128w8s3_segment_order": cfg(128, 8, 3, reverse=False),
    "n64w4s3": cfg(64, 4, 3),
    "n32w4s3": cfg(32, 4, 3),
}
#: Current kernel, dense mode (bf16 and e4m3).
DENSE_NEW = {
    "table": None,
    "n128w8s3": cfg(128, 8, 3),
    "n128w8s3_segment_order": cfg(128, 8, 3, reverse=False),
    "n64w4s3_segment_order": cfg(64, 4, 3, reverse=False),
    "n64w4s2": cfg(64, 4, 2),
    "n64w4s4": cfg(64, 4, 4),
    "n32w4s3": cfg(32, 4, 3),
    "n32w4s3_segment_order": cfg(32, 4, 3, reverse=False),
    "n32w4s4": cfg(32, 4, 4),
}
DENSE_FP8_NEW = {
    "table": None,
    "n128w8s3_segment_order": cfg(128, 8, 3, reverse=False),
    "n64w4s3": cfg(64, 4, 3),
    "n32w4s3": cfg(32, 4, 3),
}
#: The old kernel (``--baseline``): (plan, CORR_PART profiling knob: 0 full, 1 no PV update, 2 todo words only).
SPARSE_OLD = {"none": (None, 0), "scan_split": ("derive", 0)}


def variants(baseline: bool) -> list[dict]:
    """Every kernel call to time, as plain dicts (they travel to the compile workers)."""
    out = []
    for name, launch in CORRECTION_NEW.items():
        out.append(dict(name=f"new/corr_{name}", module="new", mode="sparse", plan="derive", launch=launch))
    out.append(dict(name="new/corr_table_words_given", module="new", mode="sparse", plan="words", launch=None))
    for name, launch in SPARSE_NEW.items():
        out.append(dict(name=f"new/sparse_{name}", module="new", mode="sparse", plan=None, launch=launch))
    for name, launch in DENSE_NEW.items():
        out.append(dict(name=f"new/dense_{name}", module="new", mode="dense", plan=None, launch=launch))
    for name, launch in DENSE_FP8_NEW.items():
        out.append(dict(name=f"new/dense_fp8_{name}", module="new", mode="dense", plan=None, launch=launch, fp8=True))
    if baseline:
        for name, (plan, part) in SPARSE_OLD.items():
            out.append(dict(name=f"old/{name}", module="old", mode="sparse", plan=plan, corr_part=part))
        out.append(dict(name="old/dense", module="old", mode="dense", plan=None))
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

    def fp8(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """e4m3 copies of Q/K/V with per (request, KV head) descales (made once)."""
        if not hasattr(self, "_fp8"):
            from fpv2.kernel.reference.fp8 import quantize_cache, quantize_queries

            wl = self.wl
            q8, qd = quantize_queries(wl.q, wl.batch, SHAPE["num_kv_heads"])
            k8, kd = quantize_cache(wl.k_cache, wl.batch)
            v8, vd = quantize_cache(wl.v_cache, wl.batch)
            self._fp8 = (q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd))
        return self._fp8

    def call(self, v: dict):
        """A zero-argument callable running variant ``v`` on these inputs."""
        mod = _module(v["module"])
        wl = self.wl
        q, k, v_cache, kwargs = wl.q, wl.k_cache, wl.v_cache, {}
        if v.get("fp8"):
            q, k, v_cache, descales = self.fp8()
            kwargs.update(descales)
        if v["module"] == "new" and v.get("launch") is not None:
            kwargs["launch"] = mod.LaunchConfig(**v["launch"])
        if v["module"] == "old" and v.get("corr_part"):
            kwargs["corr_part"] = v["corr_part"]
        index = None if v["mode"] == "dense" else self.index
        plan = self.plans[v["plan"]] if v.get("plan") else None
        return lambda: mod.sparse_attention_triton(q, k, v_cache, wl.batch, index, plan=plan, **kwargs)


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
    parser.add_argument("--wait-file", default="", help="before timing, wait (up to --wait-max s) for this file")
    parser.add_argument("--wait-max", type=float, default=150.0)
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

    if args.wait_file:
        waited = time.perf_counter()
        while not Path(args.wait_file).exists() and time.perf_counter() - waited < args.wait_max:
            time.sleep(1.0)
        log(f"waited {time.perf_counter() - waited:.0f}s for {args.wait_file}")

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
        elif v["name"] == "new/corr_table" and base_out is not None and out is not None:
            records[-1]["rel_diff_vs_old_scan_split"] = round(relative_l2_error(out, base_out), 6)
        del out
    del base_out

    # ---- whole pipeline: stage split
    from fpv2.index import SelectionConfig

    def time_pipeline(wl, reference: torch.Tensor) -> None:
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
            seqlen = int(wl.q.shape[0])
            rec = dict(
                name=f"pipeline/{'correction' if correction else 'no_correction'}",
                L=seqlen,
                ms=round(median(samples), 4),
                index_ms=round(median([s.index_ms for s in stages]), 4),
                correction_ms=round(median([s.correction_ms for s in stages]), 4),
                attention_ms=round(median([s.attention_ms for s in stages]), 4),
                rel_err=round(relative_l2_error(result.out, reference), 5),
                density=round(result.index.density(wl.batch), 5),
            )
            records.append(rec)
            dump()
            log(f"{rec['name']:<34} {rec['ms']:8.3f} ms (index {rec['index_ms']}, attention {rec['attention_ms']})")
            del result

    wl = sparse.wl
    time_pipeline(wl, ref)
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
    if dense_ref is not None:
        time_pipeline(dense.wl, dense_ref)

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
