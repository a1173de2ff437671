"""What prompt logprobs cost a prefill: the same prompts scored with and without them.

Workload: --num-requests prompts of --prompt-len random tokens, each generating one token
(the scoring use: SamplingParams(max_tokens=1, prompt_logprobs=k)), prefix caching off
so every run computes the same tokens in the same steps. One engine per case on the
`tiny` Llama preset (random weights: timings do not depend on them):

- none: no request asks (the baseline);
- k = 0, 5, 20: every request asks for that many top tokens per prompt position.

Each case runs the workload once to compile, then --repeats times, and reports the
fastest of those (the VM's noise only ever adds time):
prompt tokens/s and its ratio to the baseline, device and host ms per step, and update
ms (it holds the hand-over of the prompt logprobs; their dicts are made only as a caller
reads them). The extra device work is the LM head over every prompt row: 2 x rows x
hidden x vocab FLOPs, printed; the JSON adds the rate the extra time implies (None when
there is none to see). Timings are measured, never asserted. Prints a table and writes JSON:

    python benchmarks/prompt_logprobs.py --out benchmarks/results/prompt_logprobs.json
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli_args import (  # noqa: E402
    RESULTS_DIR,
    check_block_size,
    flag_message,
    out_file,
    positive_int,
    seed,
)
from benchmarks.json_report import machine_fields, write_json  # noqa: E402
from benchmarks.kv_memory import kv_cache_overflow  # noqa: E402
from jaxkv import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig  # noqa: E402
from jaxkv.models import Llama, LlamaConfig  # noqa: E402

CASES = (None, 0, 5, 20)  # SamplingParams.prompt_logprobs of every request
CONFIG_FLAGS = {  # the config fields a flag sets as it is, by the flag's name
    "block_size": "--block-size",
    "max_num_batched_tokens": "--max-num-batched-tokens",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.add_argument("--prompt-len", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--repeats", type=positive_int, default=5, help="measured runs per case")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument(
        "--out", type=out_file, default=RESULTS_DIR / "prompt_logprobs.json",
        help="JSON file (%(default)s)",
    )  # fmt: skip
    args = p.parse_args(argv)
    limit = LlamaConfig.preset("tiny").max_position_embeddings
    if args.num_requests > args.max_num_batched_tokens:  # all requests run in one batch
        p.error(
            f"--num-requests {args.num_requests} must be <= --max-num-batched-tokens "
            f"{args.max_num_batched_tokens} (each scheduled request takes a token)"
        )
    if args.prompt_len + 2 > limit:
        p.error(f"--prompt-len {args.prompt_len} + 2 exceeds the tiny preset's {limit} positions")
    check_block_size(p, args.block_size, args.prompt_len + 2, "--prompt-len + 2")
    try:  # the engine's own checks (int32 sizes, KV slots), before the model is built
        engine_config(args)
    except ValueError as e:
        p.error(flag_message(e, CONFIG_FLAGS, "the engine's config: "))
    model = LlamaConfig.preset("tiny")
    if overflow := kv_cache_overflow(engine_config(args), model, "--num-requests or --prompt-len"):
        p.error(overflow)
    return args


def engine_config(args) -> EngineConfig:
    max_len = args.prompt_len + 2
    blocks = args.num_requests * -(-max_len // args.block_size) + 1
    return EngineConfig(
        cache=CacheConfig(
            num_blocks=blocks, block_size=args.block_size, enable_prefix_caching=False
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.num_requests,
            max_model_len=max_len,
        ),
        min_num_tokens_bucket=args.max_num_batched_tokens,
        min_num_seqs_bucket=args.num_requests,
    )


def run_case(model: Llama, prompts: list[list[int]], args, k: int | None) -> dict:
    engine = Engine(model, None, engine_config(args))
    params = SamplingParams(max_tokens=1, prompt_logprobs=k)
    engine.generate(prompts, params, progress=False)  # compiles
    runs = []
    for _ in range(args.repeats):
        steps = []
        for p in prompts:
            engine.add_request(p, params)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps.append(engine.last_step)
        runs.append((time.perf_counter() - t0, steps))
    wall, steps = min(runs, key=lambda run: run[0])
    assert not any(s.new_program for _, run in runs for s in run), "a measured run compiled"
    tokens = sum(s.num_tokens for s in steps)
    num_compiles = engine.num_compiles
    engine.close()
    return {
        "prompt_logprobs": k,
        "num_steps": len(steps),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "device_ms_per_step": 1e3 * float(np.mean([s.device_s for s in steps])),
        "host_ms_per_step": 1e3 * float(np.mean([s.host_s for s in steps])),
        "update_ms_per_step": 1e3 * float(np.mean([s.update_s for s in steps])),
        "num_compiles": num_compiles,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    config = LlamaConfig.preset("tiny")
    model = Llama(config, rngs=nnx.Rngs(args.seed))
    rng = np.random.default_rng(args.seed)
    prompts = [
        rng.integers(0, config.vocab_size, args.prompt_len).tolist()
        for _ in range(args.num_requests)
    ]
    results = [run_case(model, prompts, args, k) for k in CASES]
    base = results[0]
    rows = args.num_requests * (args.prompt_len - 1)  # prompt rows of the whole run
    flops = 2 * rows * config.hidden_size * config.vocab_size
    for r in results:
        r["ratio_to_none"] = r["tokens_per_s"] / base["tokens_per_s"]
        extra_s = r["wall_s"] - base["wall_s"]
        r["extra_s"] = extra_s
        r["head_gflop"] = flops / 1e9 if r["prompt_logprobs"] is not None else 0.0
        r["implied_gflop_per_s"] = (
            r["head_gflop"] / extra_s if r["prompt_logprobs"] is not None and extra_s > 0 else None
        )
    print(
        f"{args.num_requests} prompts of {args.prompt_len} tokens, max_tokens=1, prefix "
        f"caching off; {jax.default_backend()} ({platform.processor() or platform.machine()})"
    )
    header = f"{'prompt_logprobs':>15} {'tok/s':>8} {'ratio':>6} {'steps':>5} "
    header += f"{'dev ms':>7} {'host ms':>7} {'upd ms':>7} {'extra s':>7} {'head GFLOP':>10}"
    print(header)
    for r in results:
        k = "none" if r["prompt_logprobs"] is None else str(r["prompt_logprobs"])
        print(
            f"{k:>15} {r['tokens_per_s']:>8.0f} {r['ratio_to_none']:>6.2f} {r['num_steps']:>5d} "
            f"{r['device_ms_per_step']:>7.1f} {r['host_ms_per_step']:>7.2f} "
            f"{r['update_ms_per_step']:>7.1f} {r['extra_s']:>7.3f} {r['head_gflop']:>10.2f}"
        )
    write_json(
        args.out,
        {
            "args": vars(args),
            **machine_fields(),
            "results": results,
        },
        indent=2,
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
