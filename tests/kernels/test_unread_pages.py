"""The TPU kernel copies only the pages its tiles' tokens see.

Outputs cannot show an extra page copied: every key past what a row sees is masked. Here
every page-table entry no valid sequence reads names a page past the cache, and the TPU
interpreter raises on the out-of-bounds copy that on a TPU would read outside the cache.
"""

from __future__ import annotations

import math

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.tpu import ragged_paged_attention
from tests.kernels import harness

# Decode tokens at page boundaries and inside pages, a sequence whose pages fill its
# page-table row, prefill chunks whose tiles end inside a page, an empty sequence.
SEQ_LENS = [(1, 33), (1, 32), (5, 96), (3, 3), (0, 17), (9, 60), (1, 1)]
_STATIC = ("causal", "sliding_window", "num_queries_per_block", "num_kv_pages_per_block")
_rpa = jax.jit(ragged_paged_attention, static_argnames=_STATIC + ("interpret", "sm_scale"))


@pytest.mark.skipif(not harness.INTERPRET_TPU, reason="the bounds check is the interpreter's")
@pytest.mark.parametrize(
    "pages_per_blk, queries_per_blk, sliding_window",
    [(2, 8, None), (3, 4, None), (1, 8, None), (2, 4, 5)],
)
def test_no_page_past_what_a_tile_needs_is_copied(pages_per_blk, queries_per_blk, sliding_window):
    case = harness.make_case(
        3, SEQ_LENS, num_q_heads=2, num_kv_heads=1, head_dim=128, page_size=16, pages_per_seq=6
    )
    case = harness.unread_pages_out_of_range(case)
    sm_scale = 1 / math.sqrt(128)
    out, lse = _rpa(
        *case.args(),
        causal=True,
        sliding_window=sliding_window,
        sm_scale=sm_scale,
        num_queries_per_block=queries_per_blk,
        num_kv_pages_per_block=pages_per_blk,
        interpret=pltpu.InterpretParams(out_of_bounds_reads="raise"),
    )
    expected = harness.dense_oracle(case, sm_scale=sm_scale, sliding_window=sliding_window)
    harness.assert_close_to_oracle(case, out, lse, expected)
