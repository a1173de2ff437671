"""benchmarks/serve.py's command line: the flags, their checks, and what they set up
(the engine configurations run, the model length, the requests' penalties)."""

from __future__ import annotations

import argparse

from benchmarks.cli_args import (
    RESULTS_DIR,
    check_block_size,
    flag_message,
    non_negative_int,
    out_file,
    positive_int,
    seed,
)
from benchmarks.kv_memory import kv_cache_overflow
from jaxkv import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from jaxkv.models.config import PRESETS

CONFIGS = [  # (name, enable_cascade, enable_prefix_caching)
    ("cascade+prefix_cache", True, True),
    ("flat+prefix_cache", False, True),
    ("cascade+no_prefix_cache", True, False),
    ("flat+no_prefix_cache", False, False),
]

# The SamplingParams and config fields that a flag sets as it is, by the flag's name
# (the flags' argparse dests are the SamplingParams fields' names).
PARAMS_FLAGS = {
    "repetition_penalty": "--repetition-penalty",
    "frequency_penalty": "--frequency-penalty",
    "presence_penalty": "--presence-penalty",
    "prompt_logprobs": "--prompt-logprobs",
}
CONFIG_FLAGS = {
    "block_size": "--block-size",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "min_num_tokens_bucket": "--min-tokens-bucket",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="End-to-end serving benchmark: a shared-prefix workload through jaxkv.Engine."
    )
    p.add_argument("--num-requests", type=positive_int, default=256)
    p.add_argument(
        "--system-len", type=positive_int, default=128, help="shared system prompt tokens"
    )
    p.add_argument("--question-len", type=positive_int, default=8, help="tokens of each question")
    p.add_argument(
        "--max-tokens", type=positive_int, default=32, help="generated tokens per request"
    )
    p.add_argument(
        "--samples", type=positive_int, default=1, help="SamplingParams.n of each question"
    )
    for name, default in (("repetition", 1.0), ("frequency", 0.0), ("presence", 0.0)):
        p.add_argument(
            f"--{name}-penalty", type=float, default=default, help="SamplingParams' of each"
        )
    p.add_argument(
        "--prompt-logprobs", type=int, default=None, help="SamplingParams' of each (k >= 0)"
    )
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument(
        "--long-prefill-token-threshold",
        type=non_negative_int,
        default=0,
        help="the engines' SchedulerConfig: most tokens of one request per step (0: the budget)",
    )
    p.add_argument(
        "--min-tokens-bucket",
        type=positive_int,
        default=None,
        help="the engines' min_num_tokens_bucket (default: --max-num-batched-tokens, so every "
        "step runs the model on that many token slots; smaller lets decode steps run on fewer)",
    )
    p.add_argument(
        "--decode-batch",
        type=positive_int,
        default=None,
        help="batch of the host-time goal (default: --num-requests, all of them decoding)",
    )
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=seed, default=0)
    names = ",".join(c[0] for c in CONFIGS)
    p.add_argument("--configs", default=names, help=f"comma-separated, of {names}")
    p.add_argument(
        "--out", type=out_file, default=RESULTS_DIR / "serve.json", help="JSON file (%(default)s)"
    )
    args = p.parse_args(argv)
    if args.num_requests % args.samples:
        p.error(f"--num-requests {args.num_requests} must be a multiple of --samples")
    unknown = set(args.configs.split(",")) - {c[0] for c in CONFIGS}
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {[c[0] for c in CONFIGS]}")
    if args.min_tokens_bucket is None:
        args.min_tokens_bucket = args.max_num_batched_tokens
    elif args.min_tokens_bucket > args.max_num_batched_tokens:
        p.error(
            f"--min-tokens-bucket {args.min_tokens_bucket} must be <= --max-num-batched-tokens "
            f"{args.max_num_batched_tokens}"
        )
    if args.decode_batch is None:
        args.decode_batch = args.num_requests
    elif args.decode_batch > args.num_requests:  # no step would have it: NaN host figures
        p.error(
            f"--decode-batch {args.decode_batch} must be <= --num-requests {args.num_requests} "
            "(no decode step schedules more requests than there are)"
        )
    if args.num_requests > args.max_num_batched_tokens:  # all requests run in one batch
        p.error(
            f"--num-requests {args.num_requests} must be <= --max-num-batched-tokens "
            f"{args.max_num_batched_tokens} (each scheduled request takes a token)"
        )
    try:
        penalties(args)
    except ValueError as e:  # SamplingParams' rule, named by the flag: not a traceback mid-run
        p.error(flag_message(e, PARAMS_FLAGS))
    if (args.prompt_logprobs or 0) > EngineConfig.max_logprobs:  # the engines' default
        p.error(f"--prompt-logprobs {args.prompt_logprobs} exceeds {EngineConfig.max_logprobs}")
    max_len, limit = max_model_len(args), PRESETS[args.preset].max_position_embeddings
    if max_len > limit:
        p.error(
            f"--system-len + --question-len + --max-tokens + 1 = {max_len} tokens exceed "
            f"the {limit} positions of --preset {args.preset}"
        )
    check_block_size(
        p, args.block_size, max_len, "--system-len + --question-len + --max-tokens + 1"
    )
    try:  # the engines' own checks (int32 sizes, KV slots), before the model is built
        for _, cascade, prefix_caching in CONFIGS:
            engine_config(args, cascade, prefix_caching)
    except ValueError as e:
        p.error(flag_message(e, CONFIG_FLAGS, "the engines' config: "))
    # One engine at a time holds its cache; every configuration's is the same size.
    config, model = engine_config(args, True, True), PRESETS[args.preset]
    if overflow := kv_cache_overflow(config, model, "--num-requests or the requests' length"):
        p.error(overflow)
    return args


def engine_config(args, cascade: bool, prefix_caching: bool) -> EngineConfig:
    """The EngineConfig of one of CONFIGS under these flags."""
    max_len = max_model_len(args)
    blocks_per_req = -(-max_len // args.block_size)
    return EngineConfig(
        cache=CacheConfig(
            num_blocks=args.num_requests * blocks_per_req + 1,
            block_size=args.block_size,
            enable_prefix_caching=prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.num_requests,
            max_model_len=max_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        ),
        enable_cascade=cascade,
        # Few, coarse buckets: a long run compiles a handful of programs.
        min_num_seqs_bucket=max(args.num_requests // 4, 1),
        min_num_tokens_bucket=args.min_tokens_bucket,
    )


def max_model_len(args) -> int:
    """The engine's max_model_len: a request's prompt and max_tokens, and a token of slack."""
    return args.system_len + args.question_len + args.max_tokens + 1


def penalties(args: argparse.Namespace) -> dict[str, float]:
    """The SamplingParams penalties (and prompt logprobs) the flags ask for; ValueError
    as SamplingParams's."""
    kwargs = {field: getattr(args, field) for field in PARAMS_FLAGS}
    if args.prompt_logprobs is None:
        del kwargs["prompt_logprobs"]
    SamplingParams(**kwargs)
    return kwargs
