"""End-to-end serving benchmark: a shared-prefix workload through jaxkv.Engine.

Workload: N requests that all start with one long system prompt, each followed by a
short question of its own, all queued at once; greedy decoding of --max-tokens tokens.
With --samples S, N / S questions, each queued once with SamplingParams(n=S) and sampled
at temperature 1 (seeded per question): S sequences share the system prompt and their
question, a second level of shared prefix wherever a question fills a KV block of its own
(with the default sizes it does not, and cascade plans the global level only).
--repetition-penalty / --frequency-penalty / --presence-penalty give every request those
SamplingParams penalties (jaxkv.penalties); their host cost shows in the prep column.
--prompt-logprobs K asks every request for its prompt logprobs (jaxkv.prompt_logprobs):
each then computes its whole prompt (no prefix-cache reads) and its prompt rows' logits;
under --samples, sample 0 computes its whole prompt (it alone returns them) and the
other samples read its KV from the prefix cache.
Every step runs the model on at least --min-tokens-bucket token slots (by default
--max-num-batched-tokens: one token bucket, few programs); a smaller floor runs decode
steps on fewer, where attention is a larger share of the step.
--long-prefill-token-threshold caps the tokens one request is scheduled per step, so a
long prompt's prefill leaves room in the step's budget for other requests' decodes.
Runs four engines on the same model and workload: cascade attention on/off x prefix
caching on/off, and reports per engine:

- generated tokens/s, and all (prompt + generated) tokens/s, over the steps in which
  the engine compiled nothing (without prefix caching every request computes its system
  prompt again, so all tokens/s is not comparable across the prefix-cache settings);
- cascade against flat at each prefix-cache setting over the same steps, those in which
  neither run compiled (both runs schedule the same tokens step for step): the ratio of
  generated tokens/s, and whether the two runs generated the same tokens (reported, not
  a failure: greedy decoding of random weights can meet a near-tie that float rounding
  breaks either way);
- time per step split into host (schedule + cascade plan + metadata + input arrays),
  device (jitted forward + sampler until tokens reach the host) and update;
- host ms per step in decode steps with at least --decode-batch requests scheduled
  (default: all --num-requests; the 1 ms goal at 256 running requests);
- compile count (step programs the engine needed) and the time of steps that needed
  one (excluded from the per-step figures);
- cascade steps by level, prefix-cache hit rate, KV usage peak (the most blocks held
  while a step ran, over the handable blocks).

Model: the `tiny` Llama preset with random weights (timings do not depend on the
weights). Timings are measured, never asserted. Prints a table and writes JSON (--out;
by default benchmarks/results/serve.json in this checkout):

    python benchmarks/serve.py --out benchmarks/results/serve.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.json_report import machine_fields, write_json  # noqa: E402
from benchmarks.serve_args import (  # noqa: E402
    CONFIGS,
    engine_config,
    parse_args,
    penalties,
)
from jaxkv import Engine, SamplingParams  # noqa: E402
from jaxkv.attention import default_backend  # noqa: E402
from jaxkv.models import Llama, LlamaConfig  # noqa: E402


def workload(args) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    vocab = LlamaConfig.preset(args.preset).vocab_size
    system = rng.integers(0, vocab, args.system_len).tolist()
    return [
        system + rng.integers(0, vocab, args.question_len).tolist()
        for _ in range(args.num_requests // args.samples)
    ]


def run_one(model, prompts, args, name, cascade, prefix_caching) -> dict:
    engine = Engine(model, None, engine_config(args, cascade, prefix_caching))
    penalised = penalties(args)
    for i, p in enumerate(prompts):
        if args.samples == 1:
            params = SamplingParams(max_tokens=args.max_tokens, **penalised)
        else:  # identical greedy samples would be a waste; seeded: both runs draw alike
            params = SamplingParams(
                max_tokens=args.max_tokens, n=args.samples, temperature=1.0, seed=i, **penalised
            )
        engine.add_request(p, params)
    steps, generated = [], []  # per step that ran the model: its stats, tokens it generated
    tokens: dict[tuple[str, int], list[int]] = {}  # per (request, sample): its tokens
    peak_held = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        before = engine.last_step
        outputs = engine.step()
        if engine.last_step is not before:  # the model ran (a prefill chunk may generate none)
            steps.append(engine.last_step)
            generated.append(len(outputs))
            # Held while the step ran: requests finishing in it free theirs before step()
            # returns, so the usage read after it misses the step where they all finish.
            peak_held = max(peak_held, engine.last_step.num_blocks_held)
        for o in outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    peak_usage = peak_held / (engine.manager.pool.num_blocks - 1)  # of the handable blocks
    wall = time.perf_counter() - t0
    m = engine.metrics
    engine.close()  # frees its KV cache before the next configuration builds one
    return {
        "config": name,
        "enable_cascade": cascade,
        "enable_prefix_caching": prefix_caching,
        "wall_s": wall,
        "num_steps": m.num_steps,
        "num_compiles": m.num_compiles,
        "generated_tokens_per_s": m.generation_tokens_per_s,
        "tokens_per_s": m.tokens_per_s,
        **step_figures(steps, generated, args.decode_batch),
        "cascade_steps": m.cascade_steps,
        "cascade_steps_by_levels": dict(m.cascade_steps_by_levels),
        "prefix_cache_hit_rate": m.prefix_cache_hit_rate,
        "peak_kv_usage": peak_usage,
        "metrics": m.as_dict(),
        "outputs": [tokens[k] for k in sorted(tokens)],  # left out of the JSON
    }


def step_figures(steps, generated: list[int], decode_batch: int) -> dict:
    """Figures over the steps that ran the model (their StepStats, and the tokens each
    generated): per-step times and tokens/s over those that compiled nothing, host times
    of decode steps of at least `decode_batch` requests, and the step log `paired` reads."""
    warm = [s for s in steps if not s.new_program]
    warm_generated = sum(n for s, n in zip(steps, generated, strict=True) if not s.new_program)
    decode = [s for s in warm if s.num_tokens == s.num_requests >= decode_batch]
    p50 = lambda xs: 1e3 * float(np.median(xs)) if xs else float("nan")
    mean = lambda xs: 1e3 * float(np.mean(xs)) if xs else float("nan")
    warm_s = sum(s.step_s for s in warm)
    per_s = lambda n: n / warm_s if warm_s else float("nan")
    return {
        "num_warm_steps": len(warm),
        "compile_step_s": sum(s.step_s for s in steps if s.new_program),
        # Over the steps that compiled nothing: tokens computed, and tokens generated
        # (decodes and the first token of each finished prefill).
        "warm_tokens_per_s": per_s(sum(s.num_tokens for s in warm)),
        "warm_generated_tokens_per_s": per_s(warm_generated),
        "host_ms_per_step_p50": p50([s.host_s for s in warm]),
        "host_cpu_ms_per_step_p50": p50([s.host_cpu_s for s in warm]),
        "device_ms_per_step_p50": p50([s.device_s for s in warm]),
        "update_ms_per_step_p50": p50([s.update_s for s in warm]),
        "decode_steps_at_batch": len(decode),
        "decode_host_ms_at_batch_p50": p50([s.host_s for s in decode]),
        "decode_host_cpu_ms_at_batch_p50": p50([s.host_cpu_s for s in decode]),
        "decode_host_cpu_ms_at_batch_mean": mean([s.host_cpu_s for s in decode]),
        "decode_schedule_cpu_ms_at_batch_p50": p50([s.schedule_cpu_s for s in decode]),
        "decode_plan_cpu_ms_at_batch_p50": p50([s.plan_cpu_s for s in decode]),
        "decode_prepare_cpu_ms_at_batch_p50": p50([s.prepare_cpu_s for s in decode]),
        "decode_device_ms_at_batch_p50": p50([s.device_s for s in decode]),
        "decode_update_ms_at_batch_p50": p50([s.update_s for s in decode]),
        # Per step that ran the model: (compiled, tokens computed, generated, seconds).
        "step_log": [
            (s.new_program, s.num_tokens, n, s.step_s)
            for s, n in zip(steps, generated, strict=True)
        ],
    }


def paired(cascade: dict, flat: dict) -> dict | None:
    """Cascade against flat over the steps in which neither run compiled, or None when
    the cascade run planned cascade in no step (the ratio would time flat attention
    against itself), the two runs did not schedule the same tokens step for step, or no
    such step generated a token."""
    if not cascade.get("cascade_steps", True):
        return None
    a, b = cascade["step_log"], flat["step_log"]
    if [s[1:3] for s in a] != [s[1:3] for s in b]:
        return None
    keep = [i for i in range(len(a)) if not a[i][0] and not b[i][0]]
    generated = sum(a[i][2] for i in keep)
    t_cascade, t_flat = sum(a[i][3] for i in keep), sum(b[i][3] for i in keep)
    if not (generated and t_cascade and t_flat):  # e.g. every step compiled in one run
        return None
    return {
        "outputs_identical": cascade["outputs"] == flat["outputs"],
        "steps": len(keep),
        "generated_tokens": generated,
        "cascade_generated_tokens_per_s": generated / t_cascade,
        "flat_generated_tokens_per_s": generated / t_flat,
        "speedup": t_flat / t_cascade,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    model = Llama(LlamaConfig.preset(args.preset), rngs=nnx.Rngs(args.seed))
    prompts = workload(args)
    chosen = set(args.configs.split(","))
    results = [
        run_one(model, prompts, args, name, cascade, cache)
        for name, cascade, cache in CONFIGS
        if name in chosen
    ]
    cols = [  # (header, key, format); per-step figures exclude steps that compiled
        ("config", "config", "{}"),
        ("gen tok/s", "warm_generated_tokens_per_s", "{:>9.0f}"),
        ("all tok/s", "warm_tokens_per_s", "{:>9.0f}"),
        ("steps", "num_steps", "{:>5d}"),
        ("host ms", "host_ms_per_step_p50", "{:>7.3f}"),
        ("host cpu", "host_cpu_ms_per_step_p50", "{:>8.3f}"),
        ("dev ms", "device_ms_per_step_p50", "{:>8.2f}"),
        ("upd ms", "update_ms_per_step_p50", "{:>6.3f}"),
        (f"host@{args.decode_batch}", "decode_host_ms_at_batch_p50", "{:>8.3f}"),
        (f"cpu@{args.decode_batch}", "decode_host_cpu_ms_at_batch_p50", "{:>7.3f}"),
        ("mean", "decode_host_cpu_ms_at_batch_mean", "{:>5.3f}"),
        ("sched", "decode_schedule_cpu_ms_at_batch_p50", "{:>5.3f}"),
        ("plan", "decode_plan_cpu_ms_at_batch_p50", "{:>5.3f}"),
        ("prep", "decode_prepare_cpu_ms_at_batch_p50", "{:>5.3f}"),
        ("compiles", "num_compiles", "{:>8d}"),
        ("compile s", "compile_step_s", "{:>9.1f}"),
        ("cascade", "cascade_steps", "{:>7d}"),
        ("hit rate", "prefix_cache_hit_rate", "{:>8.2f}"),
    ]
    samples = f" ({args.samples} samples per question)" if args.samples > 1 else ""
    if (args.repetition_penalty, args.frequency_penalty, args.presence_penalty) != (1, 0, 0):
        samples += (
            f" (penalties: repetition {args.repetition_penalty}, frequency "
            f"{args.frequency_penalty}, presence {args.presence_penalty})"
        )
    if args.prompt_logprobs is not None:
        samples += f" (prompt logprobs: {args.prompt_logprobs})"
    print(
        f"{args.num_requests} requests{samples}, system prompt {args.system_len} + question "
        f"{args.question_len} tokens, {args.max_tokens} generated; backend "
        f"{default_backend()} on {jax.default_backend()}; medians over steps that compiled "
        "nothing"
    )
    widths = [
        max([len(h)] + [len(fmt.format(r[key]).strip()) for r in results]) for h, key, fmt in cols
    ]
    print(" ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths, strict=True)))
    for r in results:
        cells = (fmt.format(r[key]).strip() for _, key, fmt in cols)
        print(" ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    print("host: schedule + plan + metadata (wall); cpu: the same in thread CPU time")
    print(
        f"cpu@{args.decode_batch}: median host CPU ms of decode steps with at least "
        f"{args.decode_batch} requests (mean: their mean, which includes the steps where "
        "many requests need a new block); sched / plan / prep: the median split into "
        "scheduler, cascade planner, and metadata + input arrays"
    )
    by_name = {r["config"]: r for r in results}
    pairs = {}
    for cache in ("prefix_cache", "no_prefix_cache"):
        c, f = by_name.get(f"cascade+{cache}"), by_name.get(f"flat+{cache}")
        if c is None or f is None:
            continue
        pairs[cache] = pair = paired(c, f)
        if not c["cascade_steps"]:
            print(f"{cache}: the cascade run planned cascade in no step; no ratio")
            continue
        if pair is None:
            print(f"{cache}: no step that both runs scheduled alike and neither compiled; no ratio")
            continue
        print(
            f"{cache}: cascade {pair['speedup']:.2f}x flat in generated tokens/s "
            f"({pair['cascade_generated_tokens_per_s']:.0f} against "
            f"{pair['flat_generated_tokens_per_s']:.0f}) over the {pair['steps']} steps "
            "that compiled in neither run; generated tokens identical: "
            + ("yes" if pair["outputs_identical"] else "NO")
        )
    report = {
        "args": vars(args),
        **machine_fields(),
        "attention_backend": default_backend(),
        "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results],
        "cascade_vs_flat": pairs,
    }
    write_json(args.out, report, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
