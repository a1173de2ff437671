"""The host path of one Engine step (README, "Architecture"):

1. Scheduler.schedule(): applies landed KV transfers, picks the batch, allocates blocks;
2. CascadePlanner.plan(): exact shared prefixes of the scheduled set, cost model;
3. build_attention_metadata(): padded static-shape arrays, batch in plan order;
4. one jitted program: the model forward (KV write + attention in every layer) and the
   sampler; the KV caches are donated and replaced;
5. Scheduler.update_from_output(): append tokens, stop, free blocks or hand them to the
   KV connector (which may keep them held while it copies them out).

Engine.step's body (its docstring states what a step guarantees when it is cut short):
it reads and changes the engine's scheduler, sampling rows, samples, KV caches and step
counters, so the engine is its only caller.
"""

from __future__ import annotations

import time
from typing import Any

from jaxkv.deliberate_transfers import allowing_transfers
from jaxkv.engine_lifetime import LOST, caches_lost
from jaxkv.held_interrupts import holding_interrupts
from jaxkv.logprobs import StepLogprobs
from jaxkv.metrics import StepStats
from jaxkv.outputs import RequestOutput
from jaxkv.step_inputs import in_schedule_order, program_key

__all__ = ["run_step"]


def run_step(engine: Any) -> list[RequestOutput]:
    """Engine.step (see there): runs one scheduled batch and returns the requests that got
    a token, in schedule order; [] without running the model when nothing is scheduled.
    A failure before the sampled tokens reach the host hands the batch back to the
    scheduler; once they have, the step counts in the engine's metrics and last_step,
    interrupted or not."""
    t0, c0 = time.perf_counter(), time.thread_time()
    prompt_logprobs = engine._sampling.prompt_logprobs
    engine.scheduler.discard_unapplied()  # a batch an interrupt kept from the last step
    out = engine.scheduler.schedule()
    n = out.num_requests
    if n == 0:
        return []
    held = engine.manager.pool.num_held_blocks  # before the update frees finished ones
    try:
        c_schedule = time.thread_time()
        plan = engine.planner.plan(
            out.request_ids, out.num_computed_tokens, out.num_scheduled_tokens, engine.manager
        )
        c_plan = time.thread_time()
        order, md, input_ids, sampling, prompt = engine._step_inputs(out, plan)
        width = engine._sampling.logprob_width(out.requests)  # None: no logprobs
        rows = None if prompt is None else prompt.rows
        prompt_width = 0 if rows is None else prompt_logprobs.width
        key = program_key(md, sampling, width, rows)
        new_program = key not in engine._programs
        t1, c1 = time.perf_counter(), time.thread_time()

        with allowing_transfers():  # deliberate, whatever guard the caller set
            # It donates the caches: Ctrl-C waits till it stored the new (held_interrupts)
            donated = engine.kv_caches
            with holding_interrupts(passes_on=lambda: not donated[0].is_deleted()):
                tokens, engine.kv_caches, prompt_out = engine._program(
                    engine._state_leaves,
                    input_ids,
                    md.positions,
                    engine.kv_caches,
                    md,
                    sampling,
                    rows,
                    num_logprobs=width,
                    num_prompt_logprobs=prompt_width,
                )
            if width is not None:
                logprobs = StepLogprobs(tokens[1], n, order, engine._token_texts)
                tokens = tokens[0]
            if rows is not None:
                prompt_logprobs.record(prompt, prompt_out)
            sampled = in_schedule_order(tokens, n, order)
        t2 = time.perf_counter()
    except BaseException as error:
        # The batch's allocation entered the blocks its tokens were to fill into the
        # prefix cache, but their KV was never written: a later hit would read garbage.
        engine.scheduler.discard(out)
        if caches_lost(engine.kv_caches):  # the program failed after they were donated
            error.add_note(LOST)
        raise
    if new_program:
        engine._programs.add(key)

    with holding_interrupts(passes_on=engine.scheduler.user_code):
        try:
            outputs = engine.scheduler.update_from_output(out, sampled)
            if width is not None:
                outputs = logprobs.attach(outputs, out.requests, engine._sampling.logprobs)
            outputs = prompt_logprobs.attach(outputs, prompt, engine._token_texts)
            if engine._samples:
                outputs = engine._samples.relabel(outputs)
        finally:  # also when an interrupt stops the update (the tokenizer, the connector)
            engine._sampling.discard_finished(out.requests)
            if engine._samples:
                engine._samples.discard_finished(out.requests)
            t3 = time.perf_counter()  # the model ran: the step counts, interrupted or not
            levels = "+".join(level.name for level in plan.levels)
            engine.last_step = StepStats(
                host_s=t1 - t0,
                host_cpu_s=c1 - c0,
                device_s=t2 - t1,
                update_s=t3 - t2,
                num_requests=n,
                num_tokens=len(out.token_ids),
                cascade_levels=levels,
                new_program=new_program,
                schedule_cpu_s=c_schedule - c0,
                plan_cpu_s=c_plan - c_schedule,
                prepare_cpu_s=c1 - c_plan,
                num_blocks_held=held,
            )
            engine._totals.record(engine.last_step)
    return outputs
