"""Host time of Engine.step apart from its step program, by batch size and workload.

On an accelerator the device runs a decode step of a small model in a few milliseconds;
the Python the host runs around it (schedule, cascade plan, step inputs, reading the
tokens back, the update, outputs, text) is time the device waits. This times it.

For each workload and each batch size R (--batch-sizes), R requests share a system
prompt of --system-len tokens, each followed by --question-len tokens of its own, on
the `tiny` Llama preset with random weights (the host's work does not depend on them),
with prefix caching and cascade attention on. Once every request decodes, --steps steps
are timed. A step's host time is its wall time less the step program's own call (its
dispatch and run, until its outputs are ready): the engine's program is wrapped for that.
Steps that compiled a program are left out. Workloads:

- greedy: greedy decoding;
- stream_text: greedy, with SamplingParams.stream_text, read by jaxkv.models.ByteTokenizer;
- stop: greedy, with two stop strings that never occur (ByteTokenizer);
- logprobs: greedy, with SamplingParams.logprobs=5;
- n4: R / 4 prompts with SamplingParams(n=4), sampled at temperature 1, seeded;
- mixed: greedy, and before each timed step the oldest request is aborted and a new one
  sharing the system prompt is queued: every step computes one prompt chunk (its system
  prompt read from the prefix cache) beside R - 1 decodes.

Per row: host microseconds per step (best and median of the timed steps), and the
median split from Engine.last_step: schedule, plan and prepare (thread CPU time),
update (wall), and the rest (wall: reading the tokens back, the step's bookkeeping);
the step program's own median time and the host's share of the step, host / (host +
program); and the best step against greedy decoding's at the same R (what the
workload's own work adds). On a shared machine the best step is the steadier figure.
On the CPU backend the step program's threads hold cores the host then waits for: the
figures include those waits.
Timings are measured, never asserted. Prints a table and writes JSON:

    python benchmarks/engine_host.py --out benchmarks/results/engine_host.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli_args import RESULTS_DIR, non_negative_int, out_file, positive_int  # noqa: E402
from benchmarks.json_report import machine_fields, write_json  # noqa: E402
from jaxkv import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig  # noqa: E402
from jaxkv.models import ByteTokenizer, Llama, LlamaConfig  # noqa: E402

WORKLOADS = {  # name -> (SamplingParams fields, needs the tokenizer)
    "greedy": ({}, False),
    "stream_text": ({"stream_text": True}, True),
    "stop": ({"stop": ("\x00\x01\x02", "never seen")}, True),
    "logprobs": ({"logprobs": 5}, False),
    "n4": ({"n": 4, "temperature": 1.0}, False),
    "mixed": ({}, False),
}
BLOCK_SIZE = 16
SPLIT = ("schedule_cpu_us", "plan_cpu_us", "prepare_cpu_us", "update_us", "rest_us")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--batch-sizes",
        type=lambda s: [positive_int(x) for x in s.split(",")],
        default=[16, 64, 256],
        help="requests decoding together, comma-separated (16,64,256)",
    )
    p.add_argument(
        "--workloads",
        type=_workloads,
        default=list(WORKLOADS),
        help=f"comma-separated, of {','.join(WORKLOADS)} (all)",
    )
    p.add_argument("--steps", type=positive_int, default=30, help="timed (%(default)s)")
    p.add_argument("--system-len", type=positive_int, default=600, help="(%(default)s)")
    p.add_argument("--question-len", type=positive_int, default=20, help="(%(default)s)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="(%(default)s)")
    p.add_argument(
        "--out", type=out_file, default=RESULTS_DIR / "engine_host.json", help="(%(default)s)"
    )
    args = p.parse_args(argv)
    if "n4" in args.workloads and any(r % 4 for r in args.batch_sizes):
        p.error(f"--batch-sizes {args.batch_sizes}: the n4 workload needs multiples of 4")
    return args


def _workloads(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{unknown} not of {','.join(WORKLOADS)}")
    return names


def _engine(model, args, num_requests: int, tokenizer) -> Engine:
    context = args.system_len + args.question_len + args.steps + 8
    blocks_each = -(-(args.question_len + args.steps + 8) // BLOCK_SIZE) + 1
    num_blocks = -(-args.system_len // BLOCK_SIZE) + 2 * num_requests * blocks_each + 8
    config = EngineConfig(
        cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(2048, context),
            max_num_seqs=num_requests,
            max_model_len=context + 8,
        ),
    )
    return Engine(model, config=config, tokenizer=tokenizer)


def time_workload(model, args, name: str, num_requests: int) -> dict:
    """One row: `num_requests` requests of workload `name` decoding, --steps steps timed."""
    fields, needs_tokenizer = WORKLOADS[name]
    engine = _engine(model, args, num_requests, ByteTokenizer() if needs_tokenizer else None)
    program_s = [0.0]
    program = engine._program  # the jitted call whose own time is not host time

    def timed_program(*a, **k):
        t = time.perf_counter()
        result = jax.block_until_ready(program(*a, **k))
        program_s[0] += time.perf_counter() - t
        return result

    engine._program = timed_program
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, 256, args.system_len).tolist()
    n = fields.get("n", 1)
    max_tokens = args.steps + 8  # none finishes while timed
    for i in range(num_requests // n):
        prompt = system + rng.integers(0, 256, args.question_len).tolist()
        seed = i if "temperature" in fields else None
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, seed=seed, **fields))
    for _ in range(num_requests * (args.system_len + args.question_len)):
        engine.step()  # prefill until every request decodes (a step at least a token each)
        if engine.last_step.num_tokens == engine.last_step.num_requests == num_requests:
            break
    engine.step()
    host, programs, split, levels, tokens = [], [], [], set(), []
    for _ in range(args.steps):
        if name == "mixed":
            engine.abort(next(iter(engine.scheduler.running)).request_id)
            prompt = system + rng.integers(0, 256, args.question_len).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
        program_s[0] = 0.0
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        s = engine.last_step
        if s.new_program:
            continue
        host.append(wall - program_s[0])
        programs.append(program_s[0])
        rest = wall - program_s[0] - s.host_s - s.update_s
        split.append((s.schedule_cpu_s, s.plan_cpu_s, s.prepare_cpu_s, s.update_s, rest))
        levels.add(s.cascade_levels)
        tokens.append((s.num_requests, s.num_tokens))
    engine.close()
    us = lambda xs: 1e6 * float(np.median(xs)) if xs else float("nan")
    return {
        "workload": name,
        "num_requests": num_requests,
        "timed_steps": len(host),
        "host_us_best": 1e6 * min(host) if host else float("nan"),
        "host_us_median": us(host),
        "program_us_median": us(programs),
        # what the host adds to a step of this backend: host / (host + program), medians
        "host_share": us(host) / (us(host) + us(programs)) if host else float("nan"),
        **{key: us([row[i] for row in split]) for i, key in enumerate(SPLIT)},
        "cascade_levels": sorted(levels),
        "requests_and_tokens": sorted(set(tokens)),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    model = Llama(LlamaConfig.preset("tiny"), rngs=nnx.Rngs(args.seed))
    t0 = time.perf_counter()
    rows = [
        time_workload(model, args, name, r) for name in args.workloads for r in args.batch_sizes
    ]
    greedy = {row["num_requests"]: row for row in rows if row["workload"] == "greedy"}
    for row in rows:  # what a workload's own work adds, against greedy decoding of its size
        base = greedy.get(row["num_requests"])
        row["x_greedy"] = row["host_us_best"] / base["host_us_best"] if base else None
    print(
        f"Engine.step host time without the step program, us per step ({args.steps} steps; "
        f"system prompt {args.system_len} + {args.question_len} tokens; "
        f"{jax.default_backend()})"
    )
    head = ("workload", "R", "best", "median", "sched", "plan", "prep", "update", "rest")
    tail = ("program", "share", "x greedy")
    print(
        f"{head[0]:>11} {head[1]:>4} "
        + " ".join(f"{h:>7}" for h in head[2:] + tail[:2])
        + f" {tail[2]:>8}"
    )
    for row in rows:
        cells = [row["host_us_best"], row["host_us_median"], *(row[k] for k in SPLIT)]
        x = row["x_greedy"]
        print(
            f"{row['workload']:>11} {row['num_requests']:>4} "
            + " ".join(f"{c:>7.0f}" for c in [*cells, row["program_us_median"]])
            + f" {row['host_share']:>7.0%} "
            + (f"{x:>7.2f}x" if x is not None else f"{'-':>8}")
        )
    print(
        "sched / plan / prep: thread CPU us (medians); update, rest: wall us (medians); "
        "rest: reading the tokens back and the step's own bookkeeping; program: the step "
        "program's own call (median); share: host / (host + program), medians; x greedy: "
        "best host time against greedy decoding's at the same R"
    )
    report = {
        "args": vars(args),
        **machine_fields(),
        "wall_seconds": time.perf_counter() - t0,
        "results": rows,
    }
    write_json(args.out, report, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
