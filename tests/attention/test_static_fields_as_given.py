"""paged_attention refuses a metadata's static field of the wrong type whatever jit has
compiled.

jit keys its cache on the static fields by == and hash, where 2.0 is 2 and True is 1:
a hand-made metadata with max_q_len=2.0 was refused by the kernels when first traced but
ran max_q_len=2's program once that was cached, and interpret=1, block_size=4.0 and
num_blocks=64.0 ran the programs of True, 4 and 64 unchecked.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import KVCacheManager, Request
from jaxkv.attention import paged_attention
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import CascadePlanner
from tests.attention.test_attention_argument_checks import H_KV, H_Q, D, _metadata
from tests.attention.test_cascade_planner import SHAPE


def _inputs():
    md = _metadata()  # block size 4, 64 blocks, one cascade level
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((md.max_num_tokens, H_Q, D)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((64, 4, 2 * H_KV, D)), jnp.float32)
    return md, q, pages


def _with_level_bound(md, bound):
    return dataclasses.replace(md, levels=(dataclasses.replace(md.levels[0], max_q_len=bound),))


def _changed(md, field: str, make):
    """md with `field` (a level's as "levels[0].max_q_len") set to make(its value)."""
    if field == "levels[0].max_q_len":
        return _with_level_bound(md, make(md.levels[0].max_q_len))
    return dataclasses.replace(md, **{field: make(getattr(md, field))})


def _to(value):
    return lambda _: value


@pytest.mark.parametrize(
    "field, make, match",
    [
        ("max_q_len", float, r"^metadata\.max_q_len=\d\.0 must be an int >= 1 or None$"),
        ("max_q_len", _to(True), r"^metadata\.max_q_len=True must"),
        ("max_q_len", _to(0), r"^metadata\.max_q_len=0 must be an int >= 1 or None$"),
        ("levels[0].max_q_len", float, r"^metadata\.levels\[0\]\.max_q_len=\d\.0 must"),
        ("block_size", float, r"^metadata\.block_size=4\.0 must be an int >= 1$"),
        ("block_size", _to(0), r"^metadata\.block_size=0 must be an int >= 1$"),
        ("interpret", int, r"^metadata\.interpret=0 must be a bool$"),
        ("num_blocks", float, r"^metadata\.num_blocks=64\.0 must be None or an int >= 1$"),
        ("num_blocks", _to(0), r"^metadata\.num_blocks=0 must"),
        ("backend", str.upper, r"^metadata\.backend='XLA' must be one of"),
    ],
    ids=["max_q_len float", "max_q_len bool", "max_q_len 0", "level max_q_len float",
         "block_size float", "block_size 0", "interpret int", "num_blocks float", "num_blocks 0",
         "backend"],
)  # fmt: skip
def test_a_static_field_of_the_wrong_type_is_refused_after_its_equal_compiled(field, make, match):
    md, q, pages = _inputs()
    expected = paged_attention(q, pages, md, sm_scale=0.125)  # compiles the equal key
    bad = _changed(md, field, make)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, pages, bad, sm_scale=0.125)
    # The same metadata with valid types still runs the cached program.
    np.testing.assert_array_equal(paged_attention(q, pages, md, sm_scale=0.125), expected)


def test_numpy_integers_and_no_bound_are_taken():
    """A numpy integer is an int here, as in every config; None is the kernels' "no
    bound" (each sequence may hold up to max_num_tokens query tokens)."""
    md, q, pages = _inputs()
    expected = np.asarray(paged_attention(q, pages, md, sm_scale=0.125))
    as_numpy = dataclasses.replace(
        _with_level_bound(md, np.int64(md.levels[0].max_q_len)),
        max_q_len=np.int32(md.max_q_len), block_size=np.int64(4), num_blocks=np.int64(64),
    )  # fmt: skip
    np.testing.assert_array_equal(paged_attention(q, pages, as_numpy, sm_scale=0.125), expected)
    unbounded = _with_level_bound(dataclasses.replace(md, max_q_len=None), None)
    np.testing.assert_allclose(
        paged_attention(q, pages, unbounded, sm_scale=0.125), expected, rtol=1e-5, atol=1e-5
    )


def test_one_token_blocks_a_pool_of_one_block_and_a_query_bound_of_1_are_taken():
    """1 is the least block_size, num_blocks and max_q_len: a one-token request whose
    only key sits in block 0 of a one-block cache attends to that key alone, so each
    query head's output is its KV head's value row."""
    m = KVCacheManager(4, 1, max_model_len=4)
    assert m.allocate_slots(Request("r", [5]), 1) is not None
    ones = BucketConfig(
        max_num_tokens=8, max_num_seqs=4, max_pages_per_seq=4,
        min_num_tokens=1, min_num_seqs=1, min_pages_per_seq=1,
    )  # fmt: skip
    md = build_attention_metadata(
        block_table=m.block_table, plan=CascadePlanner(SHAPE).plan(["r"], [0], [1], m),
        query_lens=np.array([1]), num_computed_tokens=np.array([0]), block_size=1, buckets=ones,
    )  # fmt: skip
    md = dataclasses.replace(md, num_blocks=1, page_indices=np.zeros_like(md.page_indices))
    assert (md.block_size, md.max_q_len, md.num_blocks, md.levels) == (1, 1, 1, ())
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((md.max_num_tokens, H_Q, D)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((1, 1, 2 * H_KV, D)), jnp.float32)
    out = np.asarray(paged_attention(q, pages, md, sm_scale=0.125))
    values = np.asarray(pages)[0, 0, 1::2]  # [H_KV, D]: V rows follow their K rows
    np.testing.assert_allclose(out[0], np.repeat(values, H_Q // H_KV, axis=0), rtol=1e-6)
