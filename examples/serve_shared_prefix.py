"""Serve a shared-prefix workload with jaxkv's Engine, with cascade attention on and off.

The workload (examples/shared_prefix_workload.py) is what a chat service sees: every
request starts with the same long preamble, then one of two system prompts with its
few-shot block, then a short question of its own. jaxkv's prefix cache stores each
shared block once, and its cascade planner finds, every step, the exact prefix the
scheduled requests share: the common preamble (level "global") and each system prompt's
block (level "groups"), which attention then reads once per group instead of once per
request.

The workload runs twice on the same model, cascade on then off; the generated tokens
must be identical (cascade is exact), and a table compares the two runs.

    python examples/serve_shared_prefix.py                     # tiny trained model, CPU
    python examples/serve_shared_prefix.py --num-requests 8 --max-tokens 8
    python examples/serve_shared_prefix.py --preset llama3_2_1b --backend pallas_tpu

With no arguments it serves the `tiny` byte-level Llama trained on the novel Botchan
(examples/train_tiny_lm.py) from the checkpoint installed with the package
(jaxkv/data/tiny). The model is a toy: it continues the text in the style of the novel
rather than answering.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import jax
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

# examples/ itself is on sys.path when this file runs as a script.
from serve_shared_prefix_args import (  # noqa: E402
    CACHED_CHECKPOINT,
    kv_blocks,
    max_model_len,
    parse_args_and_workload,
)
from serving_report import RunResult, blocks_without_sharing, print_report, print_samples  # noqa: E402
from shared_prefix_workload import Prompt, common_prefix_len  # noqa: E402

from benchmarks.cli_args import flag_message  # noqa: E402
from benchmarks.kv_memory import kv_cache_overflow  # noqa: E402
from jaxkv import (  # noqa: E402
    CacheConfig,
    Engine,
    EngineConfig,
    SamplingParams,
    SchedulerConfig,
)
from jaxkv.attention import default_backend  # noqa: E402
from jaxkv.cascade import CascadeCostModel  # noqa: E402
from jaxkv.models import (  # noqa: E402
    TINY_CHECKPOINT,
    ByteTokenizer,
    CheckpointError,
    Llama,
    LlamaConfig,
    load_checkpoint,
)
from kernels_pallas.tpu.ragged_paged_attention import SUPPORTED_HEAD_DIMS as TPU_HEAD_DIMS  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked command-line flags (serve_shared_prefix_args.py has them)."""
    return parse_args_and_workload(argv)[0]


# ----------------------------------------------------------------------------- model


def random_weights(args: argparse.Namespace) -> bool:
    """Whether the model is built from its preset's config (known before it is built)
    rather than loaded from a checkpoint."""
    return args.preset != "tiny" or args.checkpoint == "random"


def load_model(args: argparse.Namespace, console: Console) -> tuple[Llama, str]:
    """The model to serve and a line saying where its weights came from."""
    if random_weights(args):
        config = LlamaConfig.preset(args.preset)
        return Llama(config, rngs=nnx.Rngs(args.seed)), f"{args.preset}, random weights"
    path = Path(args.checkpoint) if args.checkpoint else _default_checkpoint(console)
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path  # as the README
    try:
        model = load_checkpoint(path)
    except (OSError, CheckpointError) as e:  # a missing file, or a damaged one
        raise SystemExit(f"--checkpoint {args.checkpoint or shown}: {e}") from None
    return model, f"tiny, trained checkpoint {shown}"


def _default_checkpoint(console: Console) -> Path:
    for path in (TINY_CHECKPOINT, CACHED_CHECKPOINT):
        if (path / "params.msgpack").exists():
            return path
    console.print(f"No tiny checkpoint found: training one into {CACHED_CHECKPOINT} first.")
    import train_tiny_lm  # examples/ is on sys.path when this file runs as a script

    train_tiny_lm.main([str(CACHED_CHECKPOINT)])
    return CACHED_CHECKPOINT


# ----------------------------------------------------------------------------- serving


def engine_config(args: argparse.Namespace, prompts: list[Prompt], cascade: bool) -> EngineConfig:
    bs = args.block_size
    num_blocks = kv_blocks(args, prompts)
    max_num_seqs = len(prompts)
    max_tokens_per_step = args.max_batched_tokens or max(
        64, 2 ** math.ceil(math.log2(4 * max_num_seqs))
    )
    # Static bounds on one sequence's query tokens: decode (1); a cascade group of decodes
    # (at most one token per request); anything else. Few programs, and no decode step pays
    # for prefill-sized padding.
    decode_group = 2 ** math.ceil(math.log2(max_num_seqs))
    q_len_buckets = tuple(sorted({1, min(decode_group, max_tokens_per_step), max_tokens_per_step}))
    if jax.default_backend() == "cpu":
        # Compiling dominates a CPU run and padding tokens costs little: one token bucket.
        min_tokens = max_tokens_per_step
    else:
        min_tokens = min(64, max_tokens_per_step)  # power-of-two token buckets
    always = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0.0)
    return EngineConfig(
        cache=CacheConfig(num_blocks=num_blocks, block_size=bs),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_tokens_per_step,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len(args, prompts),
        ),
        backend=args.backend,
        interpret=args.interpret,
        enable_cascade=cascade,
        cascade_cost_model=always if args.always_cascade else None,
        max_cascade_groups=2,
        min_num_tokens_bucket=min_tokens,
        min_num_seqs_bucket=max_num_seqs,
        # Power-of-two page buckets: cascade's suffix pass reads fewer (padded) pages
        # than flat attention only if it can fall into a narrower bucket.
        min_pages_bucket=4,
        q_len_buckets=q_len_buckets,
    )


def serve(
    model: Llama, prompts: list[Prompt], args: argparse.Namespace, cascade: bool, console
) -> RunResult:
    """Runs every prompt to completion on a fresh engine; all are queued at once."""
    engine = Engine(model, None, engine_config(args, prompts, cascade))
    tok = ByteTokenizer()
    params = SamplingParams(max_tokens=args.max_tokens, stop_token_ids=(ord("\n"), tok.eos_id))
    ids = [engine.add_request(p.token_ids, params) for p in prompts]
    index = {rid: i for i, rid in enumerate(ids)}
    outputs: list[list[int]] = [[] for _ in prompts]
    result = RunResult("cascade on" if cascade else "cascade off")
    progress = Progress(
        TextColumn(f"{result.name:<12}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests  {task.fields[tokens]} tokens"),
        TimeElapsedColumn(),
        console=console,
    )
    start = time.perf_counter()
    with progress:
        task = progress.add_task("serve", total=len(prompts), tokens=0)
        while engine.has_unfinished_requests():
            before = engine.last_step
            step_outputs = engine.step()
            stats = engine.last_step
            if stats is before:  # nothing could be scheduled: the model did not run
                continue
            # Logged even when it generated nothing (prefill chunks only): it took its time.
            # Held while the step ran: requests finishing in it free theirs afterwards.
            result.peak_blocks = max(result.peak_blocks, stats.num_blocks_held)
            decode_only = stats.num_tokens == stats.num_requests
            result.step_log.append(
                (stats.new_program, len(step_outputs), stats.step_s, decode_only)
            )
            for o in step_outputs:
                outputs[index[o.request_id]].extend(o.new_token_ids)
            finished = sum(o.finished for o in step_outputs)
            total_tokens = progress.tasks[0].fields["tokens"] + len(step_outputs)
            progress.update(task, advance=finished, tokens=total_tokens)
    result.wall_s = time.perf_counter() - start
    result.outputs = [tuple(o) for o in outputs]
    result.metrics = engine.metrics
    engine.close()  # frees its KV cache before the next run builds one
    return result


def check_model_fits(args, backend: str, prompts: list[Prompt], config, console) -> None:
    """SystemExit for a --backend the model or the platform cannot run, too few
    positions, or a KV cache that does not fit the device's memory beside the weights;
    falls back to xla for a head_dim the default pallas_tpu lacks."""
    if backend == "pallas_tpu" and config.head_dim not in TPU_HEAD_DIMS:
        message = (
            f"the Pallas TPU kernel needs head_dim in {TPU_HEAD_DIMS}; this model has "
            f"{config.head_dim} (try --preset llama3_2_1b)"
        )
        if args.backend:
            raise SystemExit(f"--backend pallas_tpu: {message}")
        console.print(f"Using the xla attention backend: {message}.")
        args.backend = "xla"
    platform = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}.get(args.backend)
    if platform and not args.interpret and jax.default_backend() != platform:
        raise SystemExit(  # the engine raised ValueError saying 'pass interpret=True'
            f"--backend {args.backend} compiles only on a {platform.upper()}, and JAX runs on "
            f"{jax.default_backend()} here: add --interpret to run it in interpret mode"
        )
    check_positions(args, prompts, config.max_position_embeddings)
    flags = "--num-requests, --prefix-len or --max-tokens"
    if overflow := kv_cache_overflow(engine_config(args, prompts, True), config, flags):
        raise SystemExit(overflow)


def check_positions(args: argparse.Namespace, prompts: list[Prompt], limit: int) -> None:
    """SystemExit unless the longest prompt and --max-tokens fit the model's positions."""
    need = max(len(p.token_ids) for p in prompts) + args.max_tokens  # engine's max_model_len
    if need > limit:
        raise SystemExit(
            f"--prefix-len {args.prefix_len} + questions (up to "
            f"{need - args.max_tokens - args.prefix_len} tokens) + --max-tokens "
            f"{args.max_tokens} need {need} positions; the model has {limit}"
        )


def main(argv: list[str] | None = None) -> dict:
    """Runs the example; returns the summary figures (also printed) for scripts and tests."""
    args, prompts = parse_args_and_workload(argv)
    backend = args.backend or default_backend()
    if args.interpret and backend == "xla":  # it was ignored
        raise SystemExit(
            "--interpret runs a Pallas backend in interpret mode; the backend here is xla "
            "(add --backend pallas_tpu or pallas_gpu)"
        )
    try:  # the engine's own checks (int32 sizes, KV slots), before the model is loaded
        engine_config(args, prompts, True)
    except ValueError as e:  # named by the flag that set the field, where one did
        flags = {"max_num_batched_tokens": "--max-batched-tokens", "block_size": "--block-size"}
        raise SystemExit(flag_message(e, flags, "the engine's config: ")) from None
    lengths = [len(p.token_ids) for p in prompts]
    console = Console(highlight=False)
    if random_weights(args):  # checked before the weights are built
        check_model_fits(args, backend, prompts, LlamaConfig.preset(args.preset), console)
    model, source = load_model(args, console)
    if not random_weights(args):  # a checkpoint's config, known once loaded
        check_model_fits(args, backend, prompts, model.config, console)
    cfg = engine_config(args, prompts, True)
    console.print(
        f"model: {source}\n"
        f"workload: {len(prompts)} requests, 2 system prompts; prompts {min(lengths)}-"
        f"{max(lengths)} tokens of which {args.prefix_len} shared "
        f"({common_prefix_len(args.prefix_len)} by "
        f"all, the rest by each system prompt's group); up to {args.max_tokens} new tokens\n"
        f"engine: backend {cfg.backend or default_backend()}, {cfg.cache.num_blocks - 1} KV "
        f"blocks of {args.block_size} tokens, up to {cfg.scheduler.max_num_seqs} requests and "
        f"{cfg.scheduler.max_num_batched_tokens} tokens per step"
    )
    modes = [False] if args.no_cascade else [True, False]
    runs = [serve(model, prompts, args, cascade, console) for cascade in modes]

    console.print("\nsamples (greedy):")
    print_samples(console, prompts, runs[0], args.samples)
    identical = print_report(console, prompts, runs, args.block_size)
    first = runs[0].metrics
    return {
        "num_requests": len(prompts),
        "runs": {
            r.name: r.metrics.as_dict()
            | {
                "peak_blocks": r.peak_blocks,
                "blocks_without_sharing": blocks_without_sharing(prompts, r, args.block_size),
            }
            for r in runs
        },
        "prefix_cache_hit_rate": first.prefix_cache_hit_rate,
        "cascade_steps": first.cascade_steps,
        "cascade_steps_by_levels": dict(first.cascade_steps_by_levels),
        "num_steps": first.num_steps,
        "blocks_without_sharing": blocks_without_sharing(prompts, runs[0], args.block_size),
        "outputs_identical": identical,  # None with --no-cascade: one run, no comparison
        "outputs": runs[0].outputs,
    }


if __name__ == "__main__":
    summary = main()
    if summary["outputs_identical"] is False:
        raise SystemExit("cascade on and off generated different tokens")
