"""The cascade composition of the plain-jnp reference against the float64 dense oracle:
a shared prefix read once for every sequence and each sequence's own pages, merged
through their log-sum-exps, equals flat attention over the whole context."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.reference import cascade_attention, ragged_paged_attention
from tests.kernels import harness
from tests.kernels.test_reference import rpa

pytestmark = pytest.mark.slow  # about half a minute on 2 cores: its file runs first


def _shared_prefix_case(seed, num_prefix_pages, suffixes, *, page_size=8, dtype=jnp.float32):
    """A batch whose sequences all start with the same num_prefix_pages pages.

    Shapes are fixed (6 sequences, 32 tokens, 8 pages per sequence) so that every random
    structure runs through one compiled program.
    """
    prefix = num_prefix_pages * page_size
    seq_lens = [(q, prefix + extra) for q, extra in suffixes]
    case = harness.make_case(
        seed, seq_lens, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=page_size,
        dtype=dtype, max_num_seqs=6, max_num_tokens=32, pages_per_seq=8, num_pages=64,
    )  # fmt: skip
    table = np.asarray(case.page_indices).copy()
    kv = np.asarray(case.kv_pages.astype(jnp.float32)).copy()
    shared = table[0, :num_prefix_pages].copy()
    for i in range(1, len(seq_lens)):
        kv[table[i, :num_prefix_pages]] = np.nan  # the pages each row no longer uses
        table[i, :num_prefix_pages] = shared
    return case.replace(page_indices=jnp.asarray(table), kv_pages=jnp.asarray(kv, dtype))


_jit_cascade = jax.jit(functools.partial(cascade_attention, sm_scale=0.125))


@pytest.mark.parametrize("seed", range(6))
def test_cascade_equals_oracle_on_random_shared_prefix(seed):
    rng = np.random.default_rng(seed)
    num_prefix_pages = int(rng.integers(1, 5))
    suffixes = []
    for _ in range(int(rng.integers(1, 6))):
        q_len = int(rng.choice([1, 1, 2, 5]))
        suffixes.append((q_len, q_len + int(rng.integers(0, 20))))
    case = _shared_prefix_case(seed, num_prefix_pages, suffixes)
    expected = harness.dense_oracle(case, sm_scale=0.125)
    out, lse = _jit_cascade(*case.args(), num_prefix_pages)
    harness.assert_close_to_oracle(case, out, lse, expected)
    harness.assert_padding_is_empty(case, out, lse)
    # The composition with an explicit kernel (here the reference itself) agrees too.
    out2, lse2 = cascade_attention(
        *case.args(), num_prefix_pages, sm_scale=0.125, attention_fn=ragged_paged_attention
    )
    harness.assert_close_to_oracle(case, out2, lse2, expected)


def test_cascade_refuses_a_max_q_len_its_attention_fn_would_not_see():
    case = _shared_prefix_case(0, 1, [(1, 5)])
    with pytest.raises(ValueError, match="max_q_len=1 applies to the default attention_fn"):
        cascade_attention(
            *case.args(), 1, sm_scale=0.125, attention_fn=ragged_paged_attention, max_q_len=1
        )


def test_cascade_with_no_shared_page_is_plain_attention():
    # A static num_prefix_pages of 0: the prefix pass sees no keys, the suffix pass all.
    case = _shared_prefix_case(0, 0, [(1, 5), (2, 7)])
    attend = jax.jit(functools.partial(cascade_attention, sm_scale=0.125), static_argnums=6)
    out, lse = attend(*case.args(), 0)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))


def test_a_nan_key_in_the_shared_prefix_is_nan_in_flat_and_cascade_attention():
    case = harness.nan_in_key(_shared_prefix_case(3, 2, [(1, 4), (2, 9), (1, 0)]), 0, key=3)
    rows, heads = slice(0, case.num_valid_tokens), slice(0, 4)  # q heads of kv head 0
    flat = ragged_paged_attention(*case.args(), sm_scale=0.125)
    harness.assert_nan_where_the_key_is_seen(*flat, rows, heads)
    harness.assert_nan_where_the_key_is_seen(*_jit_cascade(*case.args(), 2), rows, heads)
    assert np.isfinite(np.asarray(flat[1])[rows, 4:]).all()  # kv head 1 never sees it


def test_cascade_with_soft_cap_and_bfloat16():
    case = _shared_prefix_case(21, 3, [(1, 4), (1, 9), (3, 3)], dtype=jnp.bfloat16)
    expected = harness.dense_oracle(case, sm_scale=0.3, soft_cap=4.0)
    out, lse = cascade_attention(*case.args(), 3, sm_scale=0.3, soft_cap=4.0)
    harness.assert_close_to_oracle(case, out, lse, expected)


def _max_error(case, out, expected) -> float:
    n = case.num_valid_tokens
    return float(np.abs(np.asarray(out[:n], np.float64) - expected[0]).max())


@pytest.mark.parametrize("seed", range(4))
def test_cascade_in_bfloat16_is_as_accurate_as_flat_attention(seed):
    # Both passes return float32 partials: rounding each to bfloat16 before the merge
    # would roughly double the error of flat attention on these cases.
    suffixes = [(1, 3), (1, 9), (2, 12), (1, 20), (5, 20), (1, 1)]
    case = _shared_prefix_case(seed, 4, suffixes, dtype=jnp.bfloat16)
    expected = harness.dense_oracle(case, sm_scale=0.125)
    flat, _ = rpa(*case.args(), sm_scale=0.125)
    out, _ = _jit_cascade(*case.args(), 4)
    assert out.dtype == jnp.bfloat16
    assert _max_error(case, out, expected) <= 1.1 * _max_error(case, flat, expected)


def test_cascade_prefix_covering_a_query_is_wrong():
    # The planner's cap exists because of this: a prefix pass over pages that hold a
    # query's own position lets that query see keys after itself.
    # Called eagerly, cascade_attention refuses it by name; under jit, where values are
    # not checked, the output is wrong.
    case = _shared_prefix_case(22, 2, [(1, 3), (4, 4)])
    with pytest.raises(ValueError, match="first query position 18 lies inside the 24 tokens"):
        cascade_attention(*case.args(), 3, sm_scale=0.125)
    expected = harness.dense_oracle(case, sm_scale=0.125)
    jitted = jax.jit(functools.partial(cascade_attention, sm_scale=0.125))
    out, lse = jitted(*case.args(), 3)
    with pytest.raises(AssertionError):
        harness.assert_close_to_oracle(case, out, lse, expected)


def test_cascade_max_q_len_bounds_only_the_suffix_pass():
    # max_q_len bounds each sequence's query length; the prefix pass holds every query
    # token as one sequence, so the bound must not reach it: there it would refuse the
    # call eagerly and, under jit, leave the rows past it without their prefix keys.
    case = _shared_prefix_case(4, 2, [(2, 5), (1, 9), (3, 3)])
    expected = harness.dense_oracle(case, sm_scale=0.125)
    out, lse = cascade_attention(*case.args(), 2, sm_scale=0.125, max_q_len=3)
    harness.assert_close_to_oracle(case, out, lse, expected)
    jitted = jax.jit(functools.partial(cascade_attention, sm_scale=0.125, max_q_len=3))
    out, lse = jitted(*case.args(), 2)
    harness.assert_close_to_oracle(case, out, lse, expected)
    harness.assert_padding_is_empty(case, out, lse)


def test_a_sequence_without_queries_shorter_than_the_prefix_reads_no_suffix_keys():
    # Only sequences with query tokens must hold the prefix. One without any, holding
    # fewer keys than the prefix, gets kv_len 0 in the suffix pass, never a negative
    # one (a kernel would read it as a length; the reference refused it).
    case = _shared_prefix_case(5, 2, [(1, 4), (0, 0), (2, 9)])
    kv_lens = np.asarray(case.kv_lens).copy()
    kv_lens[1] = 3  # under the 16 prefix tokens
    case = case.replace(kv_lens=jnp.asarray(kv_lens))
    suffix_kv_lens = []

    def attention_fn(*args, causal, **kwargs):
        if causal:  # the suffix pass
            suffix_kv_lens.append(np.asarray(args[2]).tolist())
        return ragged_paged_attention(*args, causal=causal, **kwargs)

    out, lse = cascade_attention(*case.args(), 2, sm_scale=0.125, attention_fn=attention_fn)
    assert suffix_kv_lens[0][:3] == [4, 0, 9]
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))
