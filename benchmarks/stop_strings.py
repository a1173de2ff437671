"""What stop strings and streamed text cost the scheduler's update pass: decode steps with
and without them; and what a finished request's text costs (jaxkv.detokenizer).

--num-requests requests decode together on a bare Scheduler (no model: the sampled
tokens are fixed ASCII bytes), each step one schedule() and one update_from_output().
Cases: no stop strings (the baseline), and every request with one or four stop strings
that never occur, with streamed text (SamplingParams.stream_text), and with both, read
through jaxkv.models.ByteTokenizer, so every step decodes every request's new token.
Reports the median CPU time per step over --steps steps after the requests have
--warmup-tokens output tokens (the cost must not grow with the output), and its ratio to
the baseline. Then Detokenizer.text for outputs of --text-lengths tokens,
once plain and once ending in a character cut by its last byte (the text then steps back
over it), against one tokenizer.decode of the same output: the least any text costs.
Timings are measured, never asserted. Prints tables and writes JSON:

    python benchmarks/stop_strings.py --out benchmarks/results/stop_strings.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli_args import RESULTS_DIR, out_file, positive_int  # noqa: E402
from benchmarks.cpu_timing import best_us_per_call  # noqa: E402
from benchmarks.json_report import write_json  # noqa: E402
from jaxkv import KVCacheManager, Request, RequestStatus, SamplingParams  # noqa: E402
from jaxkv.allocation_args import manager_args  # noqa: E402
from jaxkv.config import SchedulerConfig  # noqa: E402
from jaxkv.detokenizer import Detokenizer  # noqa: E402
from jaxkv.models import ByteTokenizer  # noqa: E402
from jaxkv.scheduler import Scheduler  # noqa: E402

_FOUR = ("\x00\x01", "User:", "\n\nQ:", "never seen")
CASES = {  # name -> (SamplingParams.stop, stream_text) of every request
    "none": ((), False),
    "1 string": (("\x00\x01",), False),
    "4 strings": (_FOUR, False),
    "streamed": ((), True),
    "streamed + 4 strings": (_FOUR, True),
}
PROMPT_LEN = 40
# The most KV blocks time_case's manager may hold: each is a host object of about 130
# bytes, so about 130 MiB, built in about a second (the default flags need 5,633). The
# int32 bounds alone let --num-requests and the run's length ask for 2**27: over 16 GiB,
# built in minutes, once per case.
MAX_BLOCKS = 1 << 20
MAX_TEXT_TOKENS = 1 << 20  # of one finished text: its token list and text, copied a few times


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--num-requests", type=positive_int, default=256, help="decoding together (%(default)s)"
    )
    p.add_argument("--steps", type=positive_int, default=200, help="timed (%(default)s)")
    p.add_argument(
        "--warmup-tokens", type=int, default=100, help="output tokens before timing (%(default)s)"
    )
    p.add_argument(
        "--text-lengths",
        type=positive_int,
        nargs="+",
        default=[16, 256, 1024],
        help="output tokens of the finished text timed (%(default)s)",
    )
    p.add_argument(
        "--out", type=out_file, default=RESULTS_DIR / "stop_strings.json", help="(%(default)s)"
    )
    args = p.parse_args(argv)
    if args.warmup_tokens < 1:
        p.error(f"--warmup-tokens {args.warmup_tokens} must be >= 1")
    try:  # the scheduler's int32 bounds: their ValueError came mid-run, naming no flag
        scheduler_config(args)
        manager_args(*manager_sizes(args), hash_seed=0)
    except ValueError as e:
        p.error(f"--num-requests, --warmup-tokens and --steps size a run past int32: {e}")
    if longest := [n for n in args.text_lengths if n > MAX_TEXT_TOKENS]:
        p.error(f"--text-lengths {longest}: each must be at most {MAX_TEXT_TOKENS} tokens")
    num_blocks, block_size, max_len = manager_sizes(args)
    if num_blocks > MAX_BLOCKS:
        p.error(
            f"--num-requests {args.num_requests} requests of {max_len} tokens "
            f"({PROMPT_LEN} + --warmup-tokens {args.warmup_tokens} + --steps {args.steps} "
            f"+ 1) need {num_blocks} KV blocks of {block_size} tokens, past the "
            f"{MAX_BLOCKS} this benchmark builds (host objects of about 130 bytes each): "
            "make them fewer or shorter"
        )
    return args


def scheduler_config(args) -> SchedulerConfig:
    """The scheduler of time_case: every request's prompt in one step, and its run."""
    max_len = PROMPT_LEN + args.warmup_tokens + args.steps + 1
    r = args.num_requests
    return SchedulerConfig(
        max_num_batched_tokens=r * PROMPT_LEN, max_num_seqs=r, max_model_len=max_len
    )


def manager_sizes(args) -> tuple[int, int, int]:
    """(num_blocks, block_size, max_model_len) of time_case's KVCacheManager: room for
    every request's whole run."""
    max_len, block_size = scheduler_config(args).max_model_len, 16
    return args.num_requests * -(-max_len // block_size) + 1, block_size, max_len


def time_case(args, stop: tuple[str, ...], stream_text: bool) -> float:
    """Median CPU seconds of one decode step's schedule() + update_from_output()."""
    r = args.num_requests
    blocks, block_size, max_len = manager_sizes(args)
    manager = KVCacheManager(blocks, block_size, max_model_len=max_len)
    scheduler = Scheduler(scheduler_config(args), manager)
    scheduler.detokenizer = Detokenizer(ByteTokenizer())
    params = SamplingParams(max_tokens=None, ignore_eos=True, stop=stop, stream_text=stream_text)
    for i in range(r):
        scheduler.add_request(Request(str(i), [1 + i % 50] * PROMPT_LEN, params))
    times = []
    for step in range(args.warmup_tokens + args.steps):
        t0 = time.thread_time()
        out = scheduler.schedule()
        scheduler.update_from_output(out, [ord("a") + step % 26] * r)
        if step >= args.warmup_tokens:
            times.append(time.thread_time() - t0)
    assert not any(q.is_finished() for q in scheduler.running)
    return statistics.median(times)


def time_text(num_tokens: int, cut: bool) -> dict:
    """CPU microseconds of Detokenizer.text and of one plain decode of its output
    (benchmarks.cpu_timing: the best of 21 short loops)."""
    tokenizer = ByteTokenizer()
    detokenizer = Detokenizer(tokenizer)
    request = Request("r", [ord("a")] * PROMPT_LEN, SamplingParams(max_tokens=None))
    output = [ord("a") + i % 26 for i in range(num_tokens - 1)] + [0xE4 if cut else ord("z")]
    request.append_output_token_ids(output)
    request.status = RequestStatus.FINISHED_LENGTH
    text = detokenizer.text(request, None)
    assert text is not None and len(text) == num_tokens - cut
    text_us, _ = best_us_per_call(lambda r: detokenizer.text(r, None), [request])
    decode_us, _ = best_us_per_call(tokenizer.decode, [output])
    return {"tokens": num_tokens, "cut": cut, "text_us": text_us, "decode_us": decode_us,
            "ratio_to_decode": text_us / decode_us}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    results = []
    for name, (stop, stream) in CASES.items():
        step_s = time_case(args, stop, stream)
        results.append({"case": name, "stop": list(stop), "stream_text": stream, "step_s": step_s})
    base = results[0]["step_s"]
    print(
        f"{args.num_requests} decoding requests, median CPU per step over {args.steps} steps "
        f"after {args.warmup_tokens} output tokens ({platform.processor() or platform.machine()})"
    )
    print(f"{'case':>20} {'ms/step':>8} {'us/request':>10} {'ratio':>6}")
    for r in results:
        r["ratio_to_none"] = r["step_s"] / base
        r["us_per_request"] = 1e6 * r["step_s"] / args.num_requests
        print(
            f"{r['case']:>20} {1e3 * r['step_s']:>8.2f} {r['us_per_request']:>10.2f} "
            f"{r['ratio_to_none']:>6.2f}"
        )
    texts = [time_text(n, cut) for n in args.text_lengths for cut in (False, True)]
    print("\nfinished text: Detokenizer.text vs one decode (CPU us, best of 21 loops)")
    print(f"{'tokens':>7} {'cut end':>7} {'text us':>8} {'decode us':>9} {'ratio':>6}")
    for t in texts:
        print(
            f"{t['tokens']:>7} {'yes' if t['cut'] else 'no':>7} {t['text_us']:>8.1f} "
            f"{t['decode_us']:>9.1f} {t['ratio_to_decode']:>6.2f}"
        )
    write_json(
        args.out,
        {"args": vars(args), "machine": platform.platform(), "results": results, "text": texts},
        indent=2,
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
