"""Prefill time and top-1 agreement of a random Llama-shaped transformers model: ``sdpa`` against ``fpv2``.

Builds a randomly initialised :class:`transformers.LlamaForCausalLM` straight
from a :class:`transformers.LlamaConfig` (no weights are downloaded) with the
attention geometry of Llama-3.1-8B (hidden 4096, 32 query heads over 8 KV
heads, head dim 128, MLP width 14336, RoPE theta 500000 with the llama3
scaling) but only ``--layers`` decoder layers (default 2) and a vocabulary of
``--vocab-size`` tokens (default 32768; the real 128256 would make the LM head
and its logits dominate a 2-layer forward), in bf16 on CUDA. For each prompt
length of ``--seqlens`` (default 8K, 32K, 64K; B=1, seeded random token ids, no
KV cache) it runs the prefill forward with ``attn_implementation="sdpa"`` and
with ``attn_implementation="fpv2"`` (after
:func:`fpv2.serving.adapters.transformers_attention.register_fpv2_attention`
with the adapter's default sparse settings: max-threshold selection at the
:class:`fpv2.index.SelectionConfig` defaults, mean correction on, backend
``auto``) and reports:

- prefill time of the whole forward (embedding, every layer, final norm, the LM
  head over all positions): median of ``--repeats`` runs after ``--warmup``,
  CUDA events on a GPU; for fpv2 also the pipeline's index / correction /
  attention split, summed over the layers of a forward (median over the runs);
- block density, as the adapter records it (``Fpv2AttentionStats.densities``
  with ``track_density`` on), per layer, in one extra untimed forward (reading
  the density synchronises with the host, so the timed forwards do not);
- top-1 agreement: the share of positions whose argmax logit is the same under
  both implementations, over all positions and over the last ``--tail`` (1024);
- relative L2 error of the final hidden states (after the last norm) and of the
  logits, against sdpa;
- the adapter's counts: layer calls the pipeline served and calls that fell back
  to sdpa, per reason, over the timed forwards and in the accuracy forward (any
  fallback makes the fpv2 time not fpv2's: the script then exits with 1);
- a noise floor (unless ``--no-dense-reference``): the same accuracy figures for
  fpv2's dense mode (``strategy="dense"``, exact attention over every block), i.e.
  what the kernel's rounding alone changes against sdpa; one untimed forward.

The model has random weights, not trained ones, and its attention is nearly
uniform. With weights drawn at standard deviation ``s`` (``--init-std``, i.e.
``LlamaConfig.initializer_range``, default 0.02) and RMS-normalised inputs of
width ``H``, queries and keys have entries of variance ``s^2 H``, so the scaled
logits ``q . k / sqrt(d)`` spread with a standard deviation of about ``s^2 H``
(1.6 at 0.02 and H=4096): the attention's peakiness grows with the square of
``--init-std`` (0.05 gives about 10, 0.1 about 41). A block's energy sums
``exp`` of its pooled-key logits over the 128 rows of a tile, which evens out
such random spreads, so at the default every block reaches ``alpha`` of the
tile's best and the max-threshold selector keeps them all: expect density 1.0,
i.e. the dense limit of the pipeline. Seen off the device (CPU, fp32 reference
index, 8K tokens, this geometry with MLP width 1024, layers 1 and 2): density
1.0 at 0.02 and 0.05, 0.81 / 0.64 at 0.08, 0.39 / 0.32 at 0.1, 0.26 / 0.25 at
0.15. Those larger values give sparse selections, but of a random attention so
peaked that it stands in for a trained model's no better than the default does.
The measured density is reported as it is.

Expected duration on an H200 at the defaults (an estimate, not a measurement):
a 2-layer sdpa forward at 64K is about 0.25-0.35 s (attention 60-100 ms per
layer, MLP and projections about 45 ms per layer, the LM head about 30 ms),
32K about a third of that and 8K a few tens of ms; at density 1.0 the fpv2
forward does the same dense work plus the index, so take it as the same or up
to a few times slower. Each length runs 27 forwards (warm-up, timed and
accuracy runs of both implementations, the dense reference): 10-30 s in all,
plus the import of transformers, building the model and the Triton compiles of
a cold cache at the first fpv2 calls: well under the 200 s that
``benchmarks/serving_device_run.sh transformers`` gives the step.
``--time-limit`` skips the lengths that would not fit in what is left,
predicted from the previous length's medians (quadratic in L), with a message.

Writes ``transformers-long-prefill-<tag>.json`` (environment, commit, config,
one row per length, skipped lengths) and ``.md`` (the table and the notes)
under ``--out`` after every length, so a run stopped from outside keeps the
lengths it finished, and prints the table. ``--device cpu`` with tiny sizes is
a dry run of the plumbing (fp32, the reference backend); CPU times are not
prefill data.

Example::

    python benchmarks/transformers_long_prefill.py --out benchmarks/results/transformers
    python benchmarks/transformers_long_prefill.py --device cpu --dtype fp32 --seqlens 512 1024 --hidden-size 256 \\
        --q-heads 4 --kv-heads 2 --head-dim 64 --intermediate-size 512 --vocab-size 256 --min-sparse-kv-len 0 \\
        --sink-tokens 128 --window-tokens 128 --repeats 1 --warmup 0 --tail 256 --out transformers-dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fpv2.index import SelectionConfig
from fpv2.serving.environment import environment_record, git_commit, gpu_name
from fpv2.serving.metrics import relative_l2_error
from fpv2.serving.report import write_json
from fpv2.serving.routing import DTYPE_NAMES
from fpv2.serving.timing import StageClock, benchmark_device, median, protocol_notes, timed_samples

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items() if name != "fp8"}
#: Prompt lengths of the issue.
DEFAULT_SEQLENS = (8192, 32768, 65536)
#: ``attn_implementation`` names this script registers.
SPARSE_IMPL = "fpv2"
DENSE_IMPL = "fpv2_dense_reference"
#: Llama-3.1's RoPE scaling (the theta comes from ``--rope-theta``).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ORIGINAL_MAX_POSITIONS = 8192
#: Seconds added to every prediction of the next length's cost (allocation, error computations).
PREDICTION_MARGIN_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options.

    Args:
        argv: arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS), help="prompt lengths (B=1)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (Llama-3.1-8B has 32)")
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate-size", type=int, default=14336, help="MLP width (Llama-3.1-8B: 14336)")
    p.add_argument("--vocab-size", type=int, default=32768, help="vocabulary (Llama-3.1-8B: 128256)")
    p.add_argument("--init-std", type=float, default=0.02, help="LlamaConfig.initializer_range (see the docstring)")
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--alpha", type=float, default=None, help="default: SelectionConfig's")
    p.add_argument("--sink-tokens", type=int, default=None, help="default: SelectionConfig's")
    p.add_argument("--window-tokens", type=int, default=None, help="default: SelectionConfig's")
    p.add_argument("--min-sparse-kv-len", type=int, default=None, help="default: SelectionConfig's")
    p.add_argument("--strategy", default="max_threshold", help="selection strategy of the fpv2 run")
    p.add_argument("--no-correction", action="store_true", help="run fpv2 without the mean correction")
    p.add_argument("--backend", default="auto", help="attention backend (auto, triton, hopper, reference)")
    p.add_argument("--no-dense-reference", action="store_true", help="skip the fpv2 dense-mode noise floor")
    p.add_argument("--tail", type=int, default=1024, help="top-1 agreement also over the last TAIL positions")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="seeds the weights; the prompt of length L uses seed + L")
    p.add_argument("--time-limit", type=float, default=None, help="seconds; skip the lengths that would not fit")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True, help="folder for the results JSON and markdown")
    args = p.parse_args(argv)
    for name in ("layers", "hidden_size", "q_heads", "kv_heads", "head_dim", "intermediate_size", "repeats", "tail"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.vocab_size < 2:
        p.error("--vocab-size must be >= 2")
    if args.warmup < 0 or any(n < 2 for n in args.seqlens):
        p.error("--warmup must be >= 0 and every --seqlens value >= 2 (prefill, not decode)")
    if len(set(args.seqlens)) != len(args.seqlens):
        p.error("--seqlens must be distinct")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if not (args.init_std > 0 and math.isfinite(args.init_std)):
        p.error("--init-std must be positive")
    if args.time_limit is not None and not args.time_limit > 0:
        p.error("--time-limit must be positive")
    return args


def selection_config(args: argparse.Namespace) -> SelectionConfig | None:
    """The selection parameters asked for (None: the adapter's defaults, i.e. :class:`SelectionConfig`'s).

    Args:
        args: options.

    Returns:
        The config, or None when no selection option was given.
    """
    overrides = {
        name: getattr(args, name)
        for name in ("alpha", "sink_tokens", "window_tokens", "min_sparse_kv_len")
        if getattr(args, name) is not None
    }
    return SelectionConfig(**overrides) if overrides else None


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The random Llama of the options, on ``device`` in ``--dtype`` (initialised in fp32, seeded).

    Args:
        args: options.
        device: where it runs.

    Returns:
        The model, in eval mode.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.q_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(131072, *args.seqlens),
        initializer_range=args.init_std,
        rms_norm_eps=1e-5,
        rope_parameters={
            **LLAMA3_ROPE,
            "rope_theta": args.rope_theta,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS,
        },
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,
    )
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(DTYPES[args.dtype]).eval()


def prompt_ids(length: int, vocab_size: int, seed: int, device: torch.device) -> torch.Tensor:
    """``(1, length)`` random token ids, drawn on the host (the same on every device).

    Args:
        length: prompt length.
        vocab_size: ids lie in ``[0, vocab_size)``.
        seed: generator seed.
        device: where the ids go.

    Returns:
        The ids.
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=gen).to(device)


def final_outputs(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states (after the last norm) and logits: the causal LM's forward, split in two.

    Args:
        model: the causal LM.
        ids: ``(1, L)`` token ids.

    Returns:
        ``(hidden (1, L, hidden), logits (1, L, vocab))``.
    """
    with torch.inference_mode():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        return hidden, model.lm_head(hidden)


def accuracy(
    hidden: torch.Tensor, logits: torch.Tensor, ref_hidden: torch.Tensor, ref_logits: torch.Tensor, tail: int
) -> dict[str, float | int]:
    """Top-1 agreement (all positions, last ``tail``) and relative errors against the sdpa outputs.

    Args:
        hidden: final hidden states under test.
        logits: logits under test.
        ref_hidden: sdpa's final hidden states.
        ref_logits: sdpa's logits.
        tail: the last positions counted separately.

    Returns:
        ``top1_agreement``, ``top1_agreement_tail``, ``tail_positions``, ``hidden_rel_err``, ``logits_rel_err``.
    """
    same = logits.argmax(dim=-1) == ref_logits.argmax(dim=-1)  # (1, L)
    tail = min(tail, same.shape[-1])
    return {
        "top1_agreement": float(same.float().mean()),
        "top1_agreement_tail": float(same[..., -tail:].float().mean()),
        "tail_positions": tail,
        "hidden_rel_err": relative_l2_error(hidden, ref_hidden),
        "logits_rel_err": relative_l2_error(logits, ref_logits, chunk_rows=4096),
    }


def stage_split(runs: list[list[StageClock]]) -> dict[str, float] | None:
    """Per-forward sums over layers of the pipeline's stage times, median over the runs.

    Args:
        runs: per timed forward, the stage clocks of its pipeline calls.

    Returns:
        ``index_ms``, ``correction_ms``, ``attention_ms``, ``pipeline_ms``, or None without runs.
    """
    if not runs or not all(runs):
        return None
    sums = {"index_ms": [], "correction_ms": [], "attention_ms": [], "pipeline_ms": []}
    for clocks in runs:
        timings = [clock.timings() for clock in clocks]
        sums["index_ms"].append(sum(t.index_ms for t in timings))
        sums["correction_ms"].append(sum(t.correction_ms for t in timings))
        sums["attention_ms"].append(sum(t.attention_ms for t in timings))
        sums["pipeline_ms"].append(sum(t.total_ms for t in timings))
    return {key: median(values) for key, values in sums.items()}


def free_device_memory(device: torch.device) -> None:
    """Drop unreferenced tensors and return the cached blocks to the GPU (between lengths; nothing on the CPU)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def measure_length(
    args: argparse.Namespace,
    device: torch.device,
    model: torch.nn.Module,
    length: int,
    log: Callable[[str], None],
) -> dict[str, object]:
    """Time and compare sdpa and fpv2 (and the dense reference) at one prompt length.

    Args:
        args: options.
        device: where it runs.
        model: the random Llama.
        length: prompt length.
        log: progress printer.

    Returns:
        The result row.
    """
    from fpv2.serving.adapters.transformers_attention import get_fpv2_attention

    t0 = time.perf_counter()
    ids = prompt_ids(length, args.vocab_size, args.seed + length, device)
    forward = lambda: model(input_ids=ids, use_cache=False).logits  # noqa: E731

    log(f"[L={length}] sdpa: {args.warmup} warm-up + {args.repeats} timed forwards")
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        sdpa_samples = timed_samples(forward, args.warmup, args.repeats, device)[0]
    ref_hidden, ref_logits = final_outputs(model, ids)

    log(f"[L={length}] fpv2: {args.warmup} warm-up + {args.repeats} timed forwards")
    attention = get_fpv2_attention(SPARSE_IMPL)
    stats = attention.stats
    model.set_attn_implementation(SPARSE_IMPL)
    pending: list[StageClock] = []
    runs: list[list[StageClock]] = []

    def keep_clocks(result: object, timed: bool) -> None:
        if timed:
            runs.append(list(pending))
        pending.clear()

    stats.track_density = False
    stats.reset()
    remove = attention.add_prefill_hook(lambda module, batch, result: pending.append(result.clock))
    try:
        with torch.inference_mode():
            fpv2_samples = timed_samples(forward, args.warmup, args.repeats, device, on_call=keep_clocks)[0]
    finally:
        remove()
    timed_counts = {"pipeline_calls": stats.pipeline_calls, "fallbacks": dict(stats.fallbacks)}
    split = stage_split(runs)

    log(f"[L={length}] fpv2: accuracy forward (densities recorded)")
    stats.reset()
    stats.track_density = True
    try:
        hidden, logits = final_outputs(model, ids)
    finally:
        stats.track_density = False
    densities = list(stats.densities)
    accuracy_counts = {"pipeline_calls": stats.pipeline_calls, "fallbacks": dict(stats.fallbacks)}
    sparse = accuracy(hidden, logits, ref_hidden, ref_logits, args.tail)
    del hidden, logits

    dense_reference = None
    if not args.no_dense_reference:
        log(f"[L={length}] fpv2 dense mode: accuracy forward (noise floor)")
        dense_stats = get_fpv2_attention(DENSE_IMPL).stats
        dense_stats.reset()
        model.set_attn_implementation(DENSE_IMPL)
        hidden, logits = final_outputs(model, ids)
        dense_reference = {
            **accuracy(hidden, logits, ref_hidden, ref_logits, args.tail),
            "pipeline_calls": dense_stats.pipeline_calls,
            "fallbacks": dict(dense_stats.fallbacks),
        }
        del hidden, logits
    del ref_hidden, ref_logits
    model.set_attn_implementation("sdpa")

    sdpa_ms, fpv2_ms = median(sdpa_samples), median(fpv2_samples)
    row: dict[str, object] = {
        "L": length,
        "sdpa_ms": sdpa_ms,
        "fpv2_ms": fpv2_ms,
        "speedup": sdpa_ms / fpv2_ms,
        "fpv2_stages_ms": split,
        "densities": densities,
        "density_mean": sum(densities) / len(densities) if densities else None,
        **sparse,
        "pipeline_calls_timed": timed_counts["pipeline_calls"],
        "fallbacks_timed": timed_counts["fallbacks"],
        "pipeline_calls": accuracy_counts["pipeline_calls"],
        "fallbacks": accuracy_counts["fallbacks"],
        "fallback_calls": sum(timed_counts["fallbacks"].values()) + sum(accuracy_counts["fallbacks"].values()),
        "dense_reference": dense_reference,
        "sdpa_samples_ms": sdpa_samples,
        "fpv2_samples_ms": fpv2_samples,
        "seconds": time.perf_counter() - t0,
    }
    return row


def forwards_per_length(args: argparse.Namespace) -> int:
    """Forwards one length runs: warm-up and timed runs of both, the accuracy runs, the dense reference."""
    return 2 * (args.warmup + args.repeats + 1) + (0 if args.no_dense_reference else 1)


def predicted_seconds(args: argparse.Namespace, previous: dict[str, object] | None, length: int) -> float | None:
    """Predicted cost of ``length`` from the previous length's medians (quadratic in L, an upper bound).

    Args:
        args: options.
        previous: the last measured row (None: no prediction).
        length: the next prompt length.

    Returns:
        Seconds, or None without a previous row.
    """
    if previous is None:
        return None
    per_forward_s = (float(previous["sdpa_ms"]) + float(previous["fpv2_ms"])) / 2e3  # type: ignore[arg-type]
    scale = (length / int(previous["L"])) ** 2  # type: ignore[call-overload]
    return forwards_per_length(args) * per_forward_s * max(scale, 1.0) + PREDICTION_MARGIN_S


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(rows: list[dict[str, object]], tail: int) -> str:
    """The measurements as a markdown table.

    Args:
        rows: the result rows.
        tail: the ``--tail`` asked for (the header's count).

    Returns:
        The table text.
    """
    lines = [
        f"| L | sdpa ms | fpv2 ms | sdpa / fpv2 | fpv2 pipeline ms (index / corr / attn) | density per layer "
        f"| top-1 | top-1 last {tail} | hidden rel err | logits rel err | dense-mode top-1 / logits err "
        "| pipeline calls | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        split = r["fpv2_stages_ms"]
        stages = "-"
        if isinstance(split, dict):
            stages = (
                f"{split['pipeline_ms']:.2f} ({split['index_ms']:.2f} / {split['correction_ms']:.2f} / "
                f"{split['attention_ms']:.2f})"
            )
        dense = r["dense_reference"]
        floor = "-"
        if isinstance(dense, dict):
            floor = f"{dense['top1_agreement']:.4f} / {dense['logits_rel_err']:.4f}"
        densities = ", ".join(f"{d:.3f}" for d in r["densities"]) or "-"  # type: ignore[attr-defined]
        counts: dict[str, int] = dict(r["fallbacks_timed"])  # type: ignore[arg-type]
        for reason, n in r["fallbacks"].items():  # type: ignore[attr-defined]
            counts[reason] = counts.get(reason, 0) + n
        fallbacks = "; ".join(f"{k}: {v}" for k, v in counts.items()) or "0"
        lines.append(
            f"| {r['L']} | {r['sdpa_ms']:.2f} | {r['fpv2_ms']:.2f} | {r['speedup']:.2f} | {stages} | {densities} "
            f"| {r['top1_agreement']:.4f} | {r['top1_agreement_tail']:.4f} | {_fmt(r['hidden_rel_err'], '.4f')} "
            f"| {_fmt(r['logits_rel_err'], '.4f')} | {floor} | {r['pipeline_calls_timed']} | {fallbacks} |"
        )
    return "\n".join(lines)


def sdpa_flags() -> dict[str, bool]:
    """Which torch SDPA backends are enabled (torch picks among them per call)."""
    cuda = torch.backends.cuda
    return {
        "flash": cuda.flash_sdp_enabled(),
        "cudnn": cuda.cudnn_sdp_enabled(),
        "mem_efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the measurement.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``).

    Returns:
        The process exit status: 0, 1 when an fpv2 layer call fell back to sdpa, 2 on a setup error.
    """
    start = time.perf_counter()
    args = parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        device = benchmark_device(args.device)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers

        from fpv2.serving.adapters.transformers_attention import get_fpv2_attention, register_fpv2_attention
    except ImportError as exc:
        print(f"error: transformers is needed ({exc})", file=sys.stderr)
        return 2

    config = selection_config(args)
    register_fpv2_attention(
        config=config, strategy=args.strategy, correction=not args.no_correction, backend=args.backend
    )
    if not args.no_dense_reference:
        register_fpv2_attention(
            config=config, strategy="dense", correction=False, backend=args.backend, name=DENSE_IMPL
        )
    attention = get_fpv2_attention(SPARSE_IMPL)
    pipeline = attention.pipeline
    # On CPU tensors the adapter runs "auto" as the reference backend.
    backend = "reference" if device.type == "cpu" and args.backend == "auto" else pipeline.backend.name

    dry_run = "perf_counter times of tiny shapes check the plumbing; they are not prefill data"
    notes = protocol_notes(device, args.repeats, dry_run)
    notes += [
        f"random-weight model (LlamaConfig, initializer_range={args.init_std:g}), not a trained one: its attention "
        "is nearly uniform at small init std and dominated by single random keys at large ones (neither has a "
        "trained model's block structure), so density and agreement describe the adapter on this input, not on "
        "a real model",
        "ms: the whole causal-LM forward (embedding, all layers, final norm, LM head over every position), median "
        f"of {args.repeats} runs after {args.warmup} warm-up; fpv2 pipeline ms: its stages summed over the layers",
        "densities: what the adapter recorded (track_density) in one untimed forward per length; top-1 and errors "
        "against sdpa on the same weights and prompt; dense-mode: fpv2 with strategy 'dense' (rounding floor)",
    ]
    for note in notes:
        log(f"note: {note}")

    log(f"building the model ({args.layers} layers, hidden {args.hidden_size}, {args.q_heads}/{args.kv_heads} heads)")
    model = build_model(args, device)
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    tag = f"{args.dtype}-layers{args.layers}-h{args.hidden_size}-Hq{args.q_heads}-Hkv{args.kv_heads}-d{args.head_dim}"
    json_path = args.out / f"transformers-long-prefill-{tag}.json"
    md_path = args.out / f"transformers-long-prefill-{tag}.md"
    selection = pipeline.config
    header = (
        f"random Llama ({args.layers} layers, hidden {args.hidden_size}, Hq={args.q_heads} Hkv={args.kv_heads} "
        f"d={args.head_dim}, MLP {args.intermediate_size}, vocab {args.vocab_size}, init std {args.init_std:g}), "
        f"{args.dtype}, B=1, {gpu_name(device)}, transformers {transformers.__version__}, fpv2 backend {backend}, "
        f"strategy {pipeline.strategy}, alpha {selection.alpha:g}, correction {'on' if pipeline.correction else 'off'}"
    )
    rows: list[dict[str, object]] = []
    skipped: list[dict[str, object]] = []

    def write_results() -> None:
        write_json(
            json_path,
            {
                "benchmark": "transformers_long_prefill",
                "created": created,
                "commit": git_commit(),
                "gpu": gpu_name(device),
                "environment": environment_record(),
                "transformers": transformers.__version__,
                "sdpa_backends_enabled": sdpa_flags() if device.type == "cuda" else None,
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "model": {
                    "weights": "random",
                    "initializer_range": args.init_std,
                    "layers": args.layers,
                    "hidden_size": args.hidden_size,
                    "q_heads": args.q_heads,
                    "kv_heads": args.kv_heads,
                    "head_dim": args.head_dim,
                    "intermediate_size": args.intermediate_size,
                    "vocab_size": args.vocab_size,
                    "rope": {**LLAMA3_ROPE, "rope_theta": args.rope_theta},
                    "dtype": args.dtype,
                },
                "fpv2": {
                    "backend": backend,
                    "strategy": pipeline.strategy,
                    "correction": pipeline.correction,
                    "selection": dataclasses.asdict(selection),
                },
                "timer": "cuda-events" if device.type == "cuda" else "perf_counter",
                "notes": notes,
                "rows": rows,
                "skipped": skipped,
                "complete": not skipped and len(rows) == len(args.seqlens),
            },
        )
        table = markdown_table(rows, args.tail)
        extra = [f"- skipped L={s['L']}: {s['reason']}" for s in skipped]
        md_path.write_text(f"{header}\n\n{table}\n\n" + "\n".join([*(f"- {n}" for n in notes), *extra]) + "\n")

    for length in sorted(args.seqlens):
        if args.time_limit is not None:
            elapsed = time.perf_counter() - start
            need = predicted_seconds(args, rows[-1] if rows else None, length)
            if elapsed >= args.time_limit or (need is not None and elapsed + need > args.time_limit):
                reason = f"time limit {args.time_limit:g} s: {elapsed:.0f} s used" + (
                    "" if need is None else f", about {need:.0f} s needed"
                )
                log(f"skipping L={length}: {reason}")
                skipped.append({"L": length, "reason": reason})
                continue
        oom = None
        try:
            row = measure_length(args, device, model, length, log)
        except torch.cuda.OutOfMemoryError as exc:
            oom = str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
        if oom is not None:
            # Keep the lengths that fit (the traceback, and the tensors it held, are gone here).
            log(f"skipping L={length}: out of memory ({oom})")
            skipped.append({"L": length, "reason": f"out of memory: {oom}"})
            model.set_attn_implementation("sdpa")
            free_device_memory(device)
            write_results()
            continue
        rows.append(row)
        log(
            f"[L={length}] sdpa {row['sdpa_ms']:.2f} ms, fpv2 {row['fpv2_ms']:.2f} ms, densities "
            f"{[round(d, 3) for d in row['densities']]}, top-1 {row['top1_agreement']:.4f} "
            f"({time.perf_counter() - start:.0f} s so far)"
        )
        free_device_memory(device)
        write_results()
    write_results()
    print(header)
    print(markdown_table(rows, args.tail))
    for s in skipped:
        print(f"skipped L={s['L']}: {s['reason']}")
    log(f"wrote {json_path} and {md_path} ({time.perf_counter() - start:.0f} s)")
    fell_back = [r["L"] for r in rows if r["fallback_calls"]]
    if fell_back:
        print(f"error: fpv2 layer calls fell back to sdpa at L = {fell_back}: those fpv2 times are not fpv2's")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
