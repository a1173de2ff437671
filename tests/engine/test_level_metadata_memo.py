"""The metadata builder reuses a cascade plan's level metadata (the plan's level memo) only
where building it afresh would give the same arrays, under a random serving workload.

The memo is keyed by the token layout, block size and buckets, and lives on the plan
object: a mutant that dropped the layout from that key reused another step's levels.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jaxkv.step_inputs
from jaxkv import SamplingParams
from jaxkv.batch import build_attention_metadata
from tests.engine._util import VOCAB, assert_all_blocks_free, make_engine


def _level_arrays(levels) -> list[tuple]:
    return [(lv.cu_q_lens.tolist(), lv.kv_lens.tolist(), lv.page_indices.tolist()) for lv in levels]


def test_reused_level_metadata_equals_a_fresh_build_every_step(monkeypatch):
    reused, last = [], [None]

    def checked_build(**kwargs):
        md = build_attention_metadata(**kwargs)
        fresh_plan = dataclasses.replace(kwargs["plan"])  # an equal plan, its memo empty
        fresh = build_attention_metadata(**{**kwargs, "plan": fresh_plan})
        assert _level_arrays(md.levels) == _level_arrays(fresh.levels)
        if md.levels and md.levels is last[0]:
            reused.append(len(md.levels))
        last[0] = md.levels
        return md

    monkeypatch.setattr(jaxkv.step_inputs, "build_attention_metadata", checked_build)
    engine = make_engine()
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, VOCAB, n).tolist() for n in (8, 13, 20)]
    prompts, outputs, live = {}, {}, []
    # Requests over 3 system prompts join and finish at random: plans with levels change
    # while the number of decoding requests stays the same, and one plan serves a chunked
    # or joining step and then a decode-only one.
    for _ in range(300):
        if len(live) < 8 and rng.random() < 0.3:
            system = systems[int(rng.integers(3))]
            prompt = (system + rng.integers(0, VOCAB, 40).tolist())[
                : int(rng.integers(len(system) + 1, 45))
            ]
            max_tokens = int(rng.integers(1, 64 - len(prompt)))
            rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
            prompts[rid] = (prompt, max_tokens)
            live.append(rid)
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                live.remove(o.request_id)
    assert reused, "the workload must reuse some plan's levels"
    # Every finished request got exactly its max_tokens (no stop tokens given).
    assert all(len(outputs[r]) == prompts[r][1] for r in prompts if r not in live)
    for rid in live:
        engine.abort(rid)
    engine.drain_transfers()
    assert_all_blocks_free(engine)
