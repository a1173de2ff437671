"""Random serving runs on one engine, step by step, against the dense model.

Each seed draws a run (tests.engine._random_runs): requests arriving over several steps,
shared prefixes, cache salts, aborts in any state, a tight or roomy cache, small and
large token budgets, with or without a host offload whose copies land late, and in some
runs with an offload, copies that fail at random: saves whose copy fails, loads whose
copy fails after writing garbage into their blocks, and loads whose start fails, which
makes that step() raise (the run steps again, as a serving loop would). After every
step the manager's bookkeeping must be intact; at the end every request must have
generated exactly the dense model's greedy tokens under its stop tokens and min_tokens
(an aborted one, a leading part of them) with the dense model's logprobs where it asked,
every block must be back in the pool and no copy pending in the connector. The seeds
were picked so that, between them, the runs preempt, reload offloaded KV, abort requests
and plan cascade levels, stop at stop tokens, steer around a stop token banned by
min_tokens, return logprobs, finish requests of several samples, and fail saves, loads
and the start of a load; the last test checks that they still do.
"""

from __future__ import annotations

import functools

import pytest

from tests.engine._random_runs import assert_dense_tokens, draw_run, make_engines, serve
from tests.engine._util import assert_all_blocks_free, dense_greedy

SEEDS = (5005, 5008, 5020, 5026, 5034, 5037)
# 5005, 5008, 5026 and 5037 offload; 5008 and 5026 draw failing copies, and only 5008
# loads, failing a load's copy and a load's start besides saves.


@functools.cache
def served_run(seed: int):
    """(run, served) of `seed`, served once for both tests below."""
    run = draw_run(seed)
    return run, serve(run, make_engines(run))


def num_stops_banned(arrivals) -> int:
    """How many of `arrivals` have a stop token among the dense model's unbanned greedy
    tokens within their min_tokens: min_tokens kept it out, the request sampled past it."""
    banning = [a for a in arrivals if a.min_tokens and a.stop_token_ids]
    if not banning:
        return 0
    unbanned = dense_greedy([a.prompt for a in banning], [a.min_tokens for a in banning])
    return sum(
        any(t in a.stop_token_ids for t in tokens)
        for a, tokens in zip(banning, unbanned, strict=True)
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_run_generates_the_dense_models_tokens_and_frees_every_block(seed):
    run, served = served_run(seed)
    assert_dense_tokens(run, served)
    (engine,) = served.engines
    assert_all_blocks_free(engine)
    assert not engine.has_pending_transfers() and not engine.connector.has_pending()
    # Each step that raised was a load that failed to start, counted as a failed load.
    assert served.num_step_errors <= engine.connector.stats.num_failed_loads
    engine.close()  # its metrics stay readable


def test_the_seeds_between_them_preempt_reload_abort_cascade_and_fail_copies():
    paths = ("preempt", "reload", "abort", "cascade", "stop", "ban", "logprobs", "samples")
    paths += ("prompt_logprobs", "failed_save", "failed_load", "load_start_raised")
    seen = dict.fromkeys(paths, 0)
    for seed in SEEDS:
        run, served = served_run(seed)
        m = served.engines[0].metrics
        seen["preempt"] += m.num_preemptions
        seen["reload"] += m.bytes_reloaded
        seen["abort"] += len(served.aborted)
        seen["cascade"] += m.cascade_steps
        seen["stop"] += list(served.finish_reasons.values()).count("stop")
        seen["ban"] += num_stops_banned(run.arrivals)
        transfers = served.engines[0].connector.stats
        seen["failed_save"] += transfers.num_failed_saves
        # Loads whose copy failed, not counting those that failed to start (step raised).
        seen["failed_load"] += transfers.num_failed_loads - served.num_step_errors
        seen["load_start_raised"] += served.num_step_errors
        for a in run.arrivals:
            seen["logprobs"] += len(served.logprobs.get((a.request_id, 0), ()))
            seen["samples"] += a.n > 1 and a.request_id not in served.aborted
            seen["prompt_logprobs"] += a.request_id in served.prompt_logprobs
        served.engines[0].close()
    assert all(seen.values()), seen
