"""examples/serve_shared_prefix.py's command line: the flags, their checks, and the
workload and engine sizes they set.

Used by examples/serve_shared_prefix.py (which puts examples/ and the checkout on
sys.path).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from shared_prefix_workload import Prompt, min_prefix_len, shortest_prompt_len, workload

from benchmarks.cli_args import check_block_size
from jaxkv.block_pool import MAX_INT32
from jaxkv.models import TINY_CHECKPOINT

REPO = Path(__file__).resolve().parents[1]
CACHED_CHECKPOINT = REPO / ".cache" / "tiny_lm"  # git-ignored; written when none is shipped
DESCRIPTION = (
    "Serve a shared-prefix workload with jaxkv's Engine, with cascade attention on and off."
)


def parse_args_and_workload(
    argv: list[str] | None = None,
) -> tuple[argparse.Namespace, list[Prompt]]:
    """The checked command-line flags and the workload they describe, built once: some
    flags are checked against its prompts."""
    p = argparse.ArgumentParser(
        description=DESCRIPTION,
        epilog="Prints a progress bar per run, a few generated samples and a summary table.",
    )
    p.add_argument(
        "--backend",
        choices=("xla", "pallas_tpu", "pallas_gpu"),
        default=None,
        help="attention backend (default: the platform's: pallas_tpu on TPU, pallas_gpu on "
        "GPU, xla on CPU)",
    )
    p.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=384,
        help="tokens every request shares before its question: the common preamble "
        "(a third) plus its group's system prompt and few-shot block",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="most tokens generated per request (greedy; a newline also stops)",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="jaxkv checkpoint directory for --preset tiny, or 'random' for random weights "
        f"(default: {TINY_CHECKPOINT.relative_to(REPO)}, else train one into "
        f"{CACHED_CHECKPOINT.relative_to(REPO)})",
    )
    p.add_argument(
        "--preset",
        choices=("tiny", "llama3_2_1b", "llama3_8b"),
        default="tiny",
        help="model shape; the Llama-3 presets use random weights (for timing on TPU/GPU)",
    )
    p.add_argument(
        "--no-cascade",
        action="store_true",
        help="run only with cascade attention off (no comparison run)",
    )
    p.add_argument(
        "--always-cascade",
        action="store_true",
        help="plan cascade whenever two scheduled requests share a block, instead of when "
        "the backend's cost model says it pays (small workloads)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="tokens computed per step, prefill chunks plus decodes (default: a power of "
        "two, at least 64 and 4 per request)",
    )
    p.add_argument(
        "--interpret",
        action="store_true",
        help="run the Pallas kernels in interpret mode (a Pallas backend on the CPU)",
    )
    p.add_argument("--samples", type=int, default=3, help="generated samples to print")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the question order and of random weights"
    )
    args = p.parse_args(argv)
    for name in ("num_requests", "prefix_len", "max_tokens", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_batched_tokens is not None and args.max_batched_tokens < args.num_requests:
        p.error("--max-batched-tokens must be >= --num-requests (one token per request)")
    for name in ("samples", "seed"):  # a negative seed failed in numpy, naming no flag
        if getattr(args, name) < 0:
            p.error(f"--{name} must be >= 0")
    if args.seed >= 2**63:  # random weights' jax.random.key takes int64: OverflowError
        p.error(f"--seed {args.seed} must be < 2**63")
    if args.prefix_len < (least := min_prefix_len()):  # 25 and less: one system prompt
        p.error(f"--prefix-len must be >= {least} (below, the two system prompts are cut "
                "to the same words: no group has a prefix of its own)")  # fmt: skip
    if args.checkpoint == "":  # falsy: an unset shell variable served the default one
        p.error("--checkpoint is empty; give a checkpoint directory or 'random'")
    if args.always_cascade and args.no_cascade:  # was ignored: the one run plans none
        p.error("--always-cascade plans cascade; with --no-cascade the one run has it off")
    if args.preset != "tiny" and args.checkpoint not in (None, "random"):  # was ignored
        p.error(f"--checkpoint {args.checkpoint}: only --preset tiny loads a checkpoint "
                f"(--preset {args.preset} runs random weights)")  # fmt: skip
    made_of = "--prefix-len, a question and --max-tokens"
    # KV slot ids are int32 on the device: checked before the workload is built (terabytes
    # of token lists for --num-requests 2**31), then on its prompts in whole blocks.
    least = args.num_requests * (shortest_prompt_len(args.prefix_len) + args.max_tokens)
    if least > MAX_INT32 + 1:
        p.error(_past_int32_slots(args, f"at least {least} KV slots"))
    prompts = workload(args.num_requests, args.prefix_len, args.seed)
    check_block_size(p, args.block_size, max_model_len(args, prompts), made_of)
    if (slots := kv_blocks(args, prompts) * args.block_size) > MAX_INT32 + 1:
        blocks = f"{slots} KV slots (whole blocks of {args.block_size}, and the null block)"
        p.error(_past_int32_slots(args, blocks))
    return args, prompts


def _past_int32_slots(args: argparse.Namespace, need: str) -> str:
    return (
        f"--num-requests {args.num_requests}: its requests (--prefix-len, a question and "
        f"--max-tokens each) need {need}, more than the 2**31 that the device's int32 slot "
        "ids address"
    )


def max_model_len(args: argparse.Namespace, prompts: list[Prompt]) -> int:
    """The engine's max_model_len: the longest prompt and its output (not rounded up to a
    whole block: a large block would ask for positions past the model's that no request
    reaches)."""
    return max(len(p.token_ids) for p in prompts) + args.max_tokens


def kv_blocks(args: argparse.Namespace, prompts: list[Prompt]) -> int:
    """The engine's KV blocks, the null block included: room for the whole workload
    without any sharing, so never a preemption."""
    bs = args.block_size
    return sum(math.ceil((len(p.token_ids) + args.max_tokens) / bs) for p in prompts) + 1
