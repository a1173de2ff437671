"""The Pallas TPU kernel against the float64 oracle: in the TPU interpreter off a TPU
(on the CPU), compiled on a TPU (harness.INTERPRET_TPU).

Every case with the same static configuration shares one set of padded shapes, so the
interpreter compiles once per configuration and each further case costs only its run.
Lowering for TPU (Mosaic's tiling rules, which the interpreter does not apply) is checked
in test_tpu_lowering.py.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.reference import cascade_attention, prefix_pass_inputs
from kernels_pallas.tpu import check_shapes, ragged_paged_attention
from tests.kernels import harness

# Shared padded shapes: 40 query tokens, 9 sequences, 6 pages of 16 keys per sequence.
SHAPES = dict(max_num_tokens=40, max_num_seqs=9, pages_per_seq=6, num_pages=48)
# Small tiles so that tiny cases still cross q-tile, KV-block and page boundaries.
KNOBS = dict(num_queries_per_block=8, num_kv_pages_per_block=2)

# On the CPU the interpreter turns the kernel into a large XLA program whose compile
# dominates these tests; XLA's cheapest CPU pipeline compiles it about a third faster.
_FAST_COMPILE = (
    {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    if jax.default_backend() == "cpu"
    else None
)
_STATIC = (
    "sm_scale", "causal", "sliding_window", "soft_cap", "k_scale", "v_scale", "interpret",
    "num_queries_per_block", "num_kv_pages_per_block", "num_kv_heads_per_block", "out_dtype",
)  # fmt: skip
_rpa = jax.jit(ragged_paged_attention, static_argnames=_STATIC, compiler_options=_FAST_COMPILE)
_run_kernel = functools.partial(_rpa, interpret=harness.INTERPRET_TPU, **KNOBS)

# Eight decode tokens fill a q tile of 8: their rows need the row window at every offset.
DECODE = [(1, 17), (1, 1), (1, 64), (1, 33), (1, 96), (1, 16), (1, 40), (1, 2), (1, 9)]
PREFILL = [(16, 16), (5, 5), (13, 13)]
MIXED = [(1, 17), (7, 7), (3, 40), (12, 29), (1, 96)]
# In the first q tile: a decode at kv_len 17 copies a page holding 1 key and 15 NaN into
# KV buffer slot 0's second page, a decode fills slot 1, then a prefill chunk of 36 keys
# whose first rows (positions 10..15) need only page 0 of its block gets slot 0 again:
# the stale NaN sit where its keys 17..31 would be, which those rows must not see.
CHUNKED_PREFILL = [(1, 17), (1, 5), (26, 36)]


def _case(seq_lens, *, seed=0, num_q_heads=4, num_kv_heads=1, head_dim=128, page_size=16, **kw):
    shapes = dict(SHAPES)
    if page_size != 16:
        shapes["pages_per_seq"] = -(-96 // page_size)
    shapes.update(kw.pop("shapes", {}))
    return harness.make_case(
        seed,
        seq_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        **shapes,
        **kw,
    )


def _kernel(case: harness.Case, **kw):
    """The kernel with every option passed the way cascade_attention passes it, so calls
    from the tests and from the cascade composition share one compiled program."""
    options = dict(causal=True, soft_cap=None, k_scale=None, v_scale=None)
    if case.q.dtype == jnp.float32:  # cascade_attention asks for float32 partials
        options["out_dtype"] = jnp.float32
    options.update(kw)
    knobs = options.pop("knobs", {})
    sm_scale = options.pop("sm_scale", 1.0 / math.sqrt(case.q.shape[-1]))
    return _run_kernel(*case.args(), sm_scale=sm_scale, **knobs, **options)


def _run(case: harness.Case, **kw):
    out, lse = _kernel(case, **kw)
    kw.pop("knobs", None)
    kw.setdefault("sm_scale", 1.0 / math.sqrt(case.q.shape[-1]))
    return out, lse, harness.dense_oracle(case, **kw)


def _check(case: harness.Case, **kw):
    out, lse, expected = _run(case, **kw)
    harness.assert_close_to_oracle(case, out, lse, expected)
    harness.assert_padding_is_empty(case, out, lse)


@pytest.mark.parametrize(
    "seq_lens",
    [DECODE, PREFILL, MIXED, [(0, 5), (3, 3), (0, 0), (8, 70)], CHUNKED_PREFILL],
    ids=["decode", "prefill", "mixed", "empty_seqs", "chunked_prefill"],
)
def test_f32(seq_lens):
    _check(_case(seq_lens, seed=len(seq_lens)))


def test_golden_two_keys():
    # One sequence, sm_scale 1/sqrt(128), only coordinate 0 of q and K nonzero, in the
    # shared shapes (4 query heads of one KV head, all given the same q). q = sqrt(128)
    # and keys k0 = 0, k1 = ln 2 give logits 0 and ln 2, so exp gives 1 and 2. Values are
    # 3 and 6 in every coordinate: softmax (1/3, 2/3) gives out 3/3 + 12/3 = 5 and
    # lse ln 3. The first of the two query tokens sits at position 0 and sees only k0:
    # out 3, lse 0. Every other row is padding: out 0, lse -inf.
    base = _case([(2, 2)], seed=0)
    q = np.full(base.q.shape, np.nan, np.float32)
    q[:2] = 0.0
    q[:2, :, 0] = math.sqrt(128)
    kv = np.full(base.kv_pages.shape, np.nan, np.float32)  # page 0: the poisoned null page
    kv[1, :2] = 0.0
    kv[1, 1, 0, 0] = math.log(2.0)
    kv[1, 0, 1, :] = 3.0
    kv[1, 1, 1, :] = 6.0
    table = np.zeros(base.page_indices.shape, np.int32)
    table[0, 0] = 1
    case = base.replace(q=jnp.asarray(q), kv_pages=jnp.asarray(kv), page_indices=jnp.asarray(table))
    out, lse = map(np.asarray, _kernel(case))
    np.testing.assert_allclose(out[0], 3.0, rtol=1e-6)
    np.testing.assert_allclose(out[1], 5.0, rtol=1e-6)
    np.testing.assert_allclose(lse[0], 0.0, atol=1e-6)
    np.testing.assert_allclose(lse[1], math.log(3.0), rtol=1e-6)
    assert np.all(out[2:] == 0.0) and np.all(np.isneginf(lse[2:]))


def test_large_logits_stay_finite():
    # Logits of a few hundred, where exp overflows float32: the online softmax must
    # subtract its running maximum. Float32 logits that large carry about 1e-4 of
    # rounding, hence the wider bounds (an overflow gives NaN or inf, far outside them).
    case = harness.scale_queries(_case(MIXED, seed=16), 100.0)
    out, lse, expected = _run(case)
    harness.assert_close_to_oracle(case, out, lse, expected, atol=2e-4, rtol=2e-4, lse_atol=1e-4)
    harness.assert_padding_is_empty(case, out, lse)


@pytest.mark.parametrize("logit", [-8e29, -4e37, -3e38])
def test_keys_whose_logits_are_all_hugely_negative_are_still_seen(logit):
    # A running max started above every logit (say at -1e30) would never rise: such rows
    # would come back as seeing no key (out 0, lse -inf). So did finite logits below the
    # finite stand-in for -inf that masked logits took (-0.7 * float32 max = -2.4e38).
    kv = np.zeros((SHAPES["num_pages"], 16, 2, 128), np.float32)  # 1 KV head: keys, values
    kv[1, :, 0] = 1.0
    kv[1, :, 1] = np.arange(16, dtype=np.float32)[:, None]  # value j = j
    case = _case([(1, 8)]).replace(kv_pages=jnp.asarray(kv))
    case = case.replace(
        q=jnp.full_like(case.q, logit / 128), page_indices=jnp.ones_like(case.page_indices)
    )
    out, lse = _kernel(case, sm_scale=1.0)
    np.testing.assert_allclose(np.asarray(out)[0], 3.5, rtol=1e-6)  # the mean of values 0..7
    # lse is the logit (+ log(8), below float32 resolution there) up to the rounding of
    # the q.k sum of 128 float32 products, whose order follows the CPU's vector width:
    # at most 128 * 2**-24 = 7.6e-6 relative (an AVX2-only host is 1.8e-6 off).
    np.testing.assert_allclose(np.asarray(lse)[0], logit, rtol=1e-5)


@pytest.mark.parametrize("broken", [harness.drop_one_key, harness.swap_kv])
def test_broken_input_fails_the_check(broken):
    case = _case(MIXED, seed=7)
    out, lse = _kernel(broken(case))
    expected = harness.dense_oracle(case, sm_scale=1.0 / math.sqrt(case.q.shape[-1]))
    with pytest.raises(AssertionError):
        harness.assert_close_to_oracle(case, out, lse, expected)


def test_sliding_window_with_soft_cap_and_kv_head_blocks():
    # Gemma-2 style: both options at once, head_dim 64, a window shorter than a KV block
    # and than a page over long contexts, logits scaled up so that the cap bites (sm_scale
    # 0.5, not 1, so that the cap applied before or after the scale differs). 8 float32
    # KV heads (no GQA) in blocks of 4: two grid steps along the head axis. Decodes at
    # kv_len 28 and 29 put the window's first key (position - 12) on the last slot of a
    # page and on the first slot of the next: an off-by-one in the page range shows.
    case = _case(
        [(1, 90), (9, 40), (20, 20), (3, 7), (1, 28), (1, 29)],
        seed=3,
        num_q_heads=8,
        num_kv_heads=8,
        head_dim=64,
    )
    _check(
        case, sliding_window=13, soft_cap=2.0, sm_scale=0.5, knobs=dict(num_kv_heads_per_block=4)
    )


def test_gqa_group_and_page_size_that_are_no_powers_of_two():
    # 6 query heads over 2 KV heads (a group of 3, as in models with 24 query and 8 KV
    # heads) and pages of 48 keys: the kernel divides rows by the group and keys by the
    # page size with a true division, not the shift it uses for powers of two, and the
    # 3 rows of a decode token straddle the aligned 8-row windows of a 24-row q tile.
    case = _case(MIXED, seed=15, num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=48)
    _check(case)


def test_bf16_gqa_two_kv_heads():
    case = _case(MIXED, seed=5, num_q_heads=8, num_kv_heads=2, dtype=jnp.bfloat16)
    _check(case)


def test_bf16_with_float32_out_is_the_unrounded_output():
    # What a cascade pass asks for: the same result before its rounding to bfloat16.
    case = _case(MIXED, seed=5, num_q_heads=8, num_kv_heads=2, dtype=jnp.bfloat16)
    out, lse = _kernel(case)
    out32, lse32 = _kernel(case, out_dtype=jnp.float32)
    assert out.dtype == jnp.bfloat16 and out32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out32.astype(jnp.bfloat16)), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse32), np.asarray(lse))
    n = case.num_valid_tokens
    assert np.any(np.asarray(out32[:n]) != np.asarray(out[:n].astype(jnp.float32)))


def test_bf16_queries_over_a_float32_cache_compute_in_float32():
    # The kernel rounded K, V and the softmax weights to the queries' bfloat16: outputs
    # of order 1 8.1e-3 off the float64 oracle, lse 2.5e-3, where the float32 cache holds
    # them exactly. Both dots now run in float32 (the wider dtype): 5e-7 off, within
    # float32's tolerance with out_dtype float32 (a cascade pass); a bfloat16 out is that
    # result rounded once.
    case = _case(
        MIXED, seed=5, num_q_heads=8, num_kv_heads=2, dtype=jnp.bfloat16, kv_dtype=jnp.float32
    )
    out32, lse32 = _kernel(case, out_dtype=jnp.float32)
    expected = harness.dense_oracle(case, sm_scale=1.0 / math.sqrt(case.q.shape[-1]))
    harness.assert_close_to_oracle(case, out32, lse32, expected, dtype=jnp.float32)
    harness.assert_padding_is_empty(case, out32, lse32)
    out, lse = _kernel(case)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out32.astype(jnp.bfloat16)), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse32), np.asarray(lse))


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,k_scale,v_scale,soft_cap",
    [
        (jnp.bfloat16, jnp.int8, 0.02, 0.01, 1.0),  # k_scale scales the logits the cap sees
        (jnp.float32, jnp.float8_e4m3fn, 0.5, 2.0, None),
    ],
    ids=["int8_bf16_soft_cap", "fp8_f32"],
)
def test_quantized_kv(q_dtype, kv_dtype, k_scale, v_scale, soft_cap):
    case = _case(MIXED, seed=8, dtype=q_dtype, kv_dtype=kv_dtype, page_size=32)
    _check(case, k_scale=k_scale, v_scale=v_scale, soft_cap=soft_cap)


def _prefix_pass_case(case: harness.Case, prefix_len: int) -> harness.Case:
    """The cascade prefix pass of `case`: one sequence holding all its query tokens, over
    the first `prefix_len` keys of its first sequence (built by the reference's helper)."""
    kv_lens, page_indices, cu_q_lens, num_seqs = prefix_pass_inputs(
        case.cu_q_lens, case.num_seqs, case.page_indices[0], prefix_len
    )
    return case.replace(
        kv_lens=kv_lens,
        page_indices=page_indices,
        cu_q_lens=cu_q_lens,
        num_seqs=num_seqs,
        seq_lens=((case.num_valid_tokens, prefix_len),),
    )


@pytest.mark.parametrize("prefix_len", [17, 9])
def test_prefix_pass_non_causal(prefix_len):
    # Every query token of the batch (23 of them: more than 9 keys, fewer than 17) sees
    # every prefix key, whatever its position.
    case = _prefix_pass_case(_case(MIXED[:4], seed=9), prefix_len)
    _check(case, causal=False)


def test_cascade_composition_equals_plain_attention():
    # Prefix pass (non-causal) and suffix pass (causal) both by this kernel, merged: equal
    # to plain causal attention over each whole context.
    num_prefix_pages = 2
    prefix = 16 * num_prefix_pages
    seq_lens = [(1, prefix + 9), (3, prefix + 20), (1, prefix + 1), (6, prefix + 30)]
    case = _case(seq_lens, seed=11)
    # Every sequence starts with the first sequence's prefix pages.
    table = np.asarray(case.page_indices).copy()
    kv = np.asarray(case.kv_pages).copy()
    for i in range(1, len(seq_lens)):
        kv[table[i, :num_prefix_pages]] = kv[table[0, :num_prefix_pages]]
        table[i, :num_prefix_pages] = table[0, :num_prefix_pages]
    case = case.replace(page_indices=jnp.asarray(table), kv_pages=jnp.asarray(kv))
    sm_scale = 1.0 / math.sqrt(case.q.shape[-1])
    out, lse = cascade_attention(
        *case.args(), num_prefix_pages, sm_scale=sm_scale, attention_fn=_run_kernel
    )
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=sm_scale))


def test_a_nan_key_in_the_shared_prefix_is_nan_in_flat_and_cascade_attention():
    seq_lens = [(1, 41), (3, 52), (1, 33), (6, 62)]  # 2 shared pages, then each its own
    case = _case(seq_lens, seed=11)
    table = np.asarray(case.page_indices).copy()
    table[1:, :2] = table[0, :2]
    case = harness.nan_in_key(case.replace(page_indices=jnp.asarray(table)), seq=0, key=3)
    rows, heads = slice(0, case.num_valid_tokens), slice(None)  # one kv head: all q heads
    harness.assert_nan_where_the_key_is_seen(*_kernel(case), rows, heads)
    sm_scale = 1.0 / math.sqrt(case.q.shape[-1])
    out, lse = cascade_attention(*case.args(), 2, sm_scale=sm_scale, attention_fn=_run_kernel)
    harness.assert_nan_where_the_key_is_seen(out, lse, rows, heads)


def test_empty_batch_gives_zero_and_neg_inf():
    case = _case(MIXED, seed=12)
    out, lse = _kernel(case.replace(num_seqs=jnp.array([0], jnp.int32)))
    assert np.all(np.asarray(out) == 0.0) and np.all(np.isneginf(np.asarray(lse)))


def test_double_buffering_has_no_data_races():
    # The interpreter's happens-before race detector watches every DMA into the two KV
    # buffer slots and every read of them: a block read before its copy was waited for,
    # or overwritten by the next prefetch while in use, is reported as a race.
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    case = _case(MIXED, seed=14)
    sm_scale = 1.0 / math.sqrt(case.q.shape[-1])
    params = pltpu.InterpretParams(detect_races=True)
    out, lse = _rpa(*case.args(), sm_scale=sm_scale, interpret=params, **KNOBS)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=sm_scale))
    assert interpret_pallas_call.races is not None
    assert not interpret_pallas_call.races.races_found


def test_a_scale_whose_folded_factor_is_inf_in_float32_is_refused():
    # The kernel scales the scores by sm_scale * k_scale in one float32 factor: 1e40, inf.
    case = _case([(1, 5)], kv_dtype=jnp.int8)
    with pytest.raises(ValueError, match=r"sm_scale \* k_scale = 1e\+40 must be finite"):
        jax.eval_shape(
            functools.partial(
                ragged_paged_attention, sm_scale=1e20, k_scale=1e20, v_scale=1.0, interpret=True
            ),
            *case.args(),
        )


@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "head_dim, page_size", [(128, 16), (96, 16), (64, 8), (64, 24), (256, 512)]
)
def test_check_shapes_is_the_kernels_own_rule(q_dtype, head_dim, page_size):
    # benchmarks/tpu_kernel.py repeated the rule (and could drift from it): it now calls
    # check_shapes, which the kernel's validation calls too.
    case = _case([(1, 5)], head_dim=head_dim, page_size=page_size, dtype=q_dtype)
    trace = functools.partial(ragged_paged_attention, sm_scale=1.0, interpret=True)
    try:
        check_shapes(head_dim, page_size, q_dtype)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e).split(" must ")[1])):
            jax.eval_shape(trace, *case.args())
    else:
        jax.eval_shape(trace, *case.args())
