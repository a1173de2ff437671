"""The plain-jnp reference against the float64 dense oracle (its cascade composition:
test_reference_cascade.py)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.reference import ragged_paged_attention
from tests.kernels import harness

pytestmark = pytest.mark.slow  # about a minute on 2 cores: its file runs first

_STATIC = (
    "sm_scale", "causal", "sliding_window", "soft_cap", "k_scale", "v_scale", "max_q_len",
    "out_dtype",
)  # fmt: skip
rpa = jax.jit(ragged_paged_attention, static_argnames=_STATIC)

MIXED = [(1, 17), (7, 7), (3, 40), (1, 1), (12, 29)]


def _check(case: harness.Case, *, max_q_len=None, **kw):
    sm_scale = kw.pop("sm_scale", 1.0 / math.sqrt(case.q.shape[-1]))
    out, lse = rpa(*case.args(), sm_scale=sm_scale, max_q_len=max_q_len, **kw)
    harness.assert_close_to_oracle(
        case, out, lse, harness.dense_oracle(case, sm_scale=sm_scale, **kw)
    )
    harness.assert_padding_is_empty(case, out, lse)
    return out, lse


def test_golden_two_keys():
    # One sequence, one head, head_dim 1, sm_scale 1: q = 1, keys k0 = 0 and k1 = ln 2,
    # values v0 = 3 and v1 = 6. Logits are 0 and ln 2, so exp gives 1 and 2:
    # softmax = (1/3, 2/3), out = 3/3 + 2*6/3 = 5, lse = ln(1 + 2) = ln 3.
    # The second query token of a 2-token prefill sits at position 1 and sees both keys;
    # the first sits at position 0 and sees only k0: out = 3, lse = 0.
    q = jnp.array([[[1.0]], [[1.0]]])
    kv = np.full((2, 2, 2, 1), np.nan, np.float32)  # page 0 is the (poisoned) null page
    kv[1, 0] = [[0.0], [3.0]]
    kv[1, 1] = [[math.log(2.0)], [6.0]]
    out, lse = ragged_paged_attention(
        q,
        jnp.asarray(kv),
        jnp.array([2], jnp.int32),
        jnp.array([[1]], jnp.int32),
        jnp.array([0, 2], jnp.int32),
        jnp.array([1], jnp.int32),
        sm_scale=1.0,
    )
    np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [3.0, 5.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse)[:, 0], [0.0, math.log(3.0)], atol=1e-6)


@pytest.mark.parametrize("max_num_seqs", [2, 3])  # per-sequence and per-token layouts
def test_a_valid_sequence_without_keys_gives_zero_and_minus_inf(max_num_seqs):
    # A cascade level's gap: a valid sequence with query tokens and kv_len 0. Its rows
    # must give lse -inf (any finite lse would weigh its 0 output into the LSE merge);
    # the next sequence's row (keys 0 and ln 2, values 3 and 6, non-causal) gives 5, ln 3.
    q = jnp.ones((2, 1, 1), jnp.float32)
    kv = np.full((2, 2, 2, 1), np.nan, np.float32)  # page 0 is the (poisoned) null page
    kv[1, 0] = [[0.0], [3.0]]
    kv[1, 1] = [[math.log(2.0)], [6.0]]
    pad = max_num_seqs - 2
    out, lse = rpa(
        q,
        jnp.asarray(kv),
        jnp.array([0, 2] + [0] * pad, jnp.int32),
        jnp.array([[0], [1]] + [[0]] * pad, jnp.int32),
        jnp.array([0, 1, 2] + [2] * pad, jnp.int32),
        jnp.array([2], jnp.int32),
        sm_scale=1.0,
        causal=False,
    )
    out, lse = np.asarray(out)[:, 0, 0], np.asarray(lse)[:, 0]
    assert out[0] == 0.0 and lse[0] == -np.inf
    np.testing.assert_allclose([out[1], lse[1]], [5.0, math.log(3.0)], rtol=1e-6)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [8, 16, 32])
def test_mixed_batches(group, head_dim, page_size):
    seed = group * 1000 + head_dim + page_size
    case = harness.make_case(
        seed, MIXED, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size
    )
    _check(case)


@pytest.mark.parametrize(
    "seq_lens",
    [
        pytest.param([(1, 33), (1, 5), (1, 64), (1, 1)], id="decode_only"),
        pytest.param([(20, 20), (9, 9), (1, 1)], id="prefill_only"),
        pytest.param([(6, 30), (2, 9), (11, 11)], id="chunked_prefill"),
        pytest.param([(0, 16), (3, 9)], id="empty_query"),
    ],
)
def test_named_batches(seq_lens):
    case = harness.make_case(7, seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    _check(case)


def test_bfloat16_within_stated_bound():
    case = harness.make_case(
        3, MIXED, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=jnp.bfloat16
    )
    _check(case)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(sliding_window=5), id="sliding_window"),
        pytest.param(dict(sliding_window=1), id="sliding_window_1"),
        # The longest window accepted (int32 positions): every causal key visible.
        pytest.param(dict(sliding_window=2**31 - 1), id="sliding_window_int32_max"),
        pytest.param(dict(soft_cap=3.0, sm_scale=1.0), id="soft_cap"),
        pytest.param(dict(causal=False), id="non_causal"),
        pytest.param(dict(soft_cap=2.0, sliding_window=9, sm_scale=0.5), id="cap_and_window"),
    ],
)
@pytest.mark.parametrize(
    "seq_lens, max_q_len",
    # The first batch takes the per-token layout, the second the per-sequence one.
    [(MIXED, None), ([(12, 29), (7, 7)], 12)],
    ids=["per_token", "per_sequence"],
)
def test_options(options, seq_lens, max_q_len):
    case = harness.make_case(11, seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    _check(case, max_q_len=max_q_len, **options)


@pytest.mark.parametrize(
    "seq_lens, max_q_len",
    [(MIXED, None), ([(12, 29), (7, 7)], 12)],
    ids=["per_token", "per_sequence"],
)
def test_large_logits_stay_finite(seq_lens, max_q_len):
    # Logits of a few hundred, where exp overflows float32: the softmax must subtract each
    # row's maximum. Float32 logits that large carry about 1e-4 of rounding, hence the
    # wider bounds (an overflow gives NaN or inf, far outside them).
    case = harness.make_case(17, seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    case = harness.scale_queries(case, 100.0)
    out, lse = rpa(*case.args(), sm_scale=0.125, max_q_len=max_q_len)
    expected = harness.dense_oracle(case, sm_scale=0.125)
    harness.assert_close_to_oracle(case, out, lse, expected, atol=2e-4, rtol=2e-4, lse_atol=1e-4)


@pytest.mark.parametrize(
    "kv_dtype, scale",
    [(jnp.int8, 0.01), (jnp.float8_e4m3fn, 0.5)],
    ids=["int8", "fp8"],
)
def test_quantized_kv(kv_dtype, scale):
    case = harness.make_case(
        5, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, kv_dtype=kv_dtype
    )
    _check(case, k_scale=scale, v_scale=scale * 2)


def test_max_q_len_bound_for_decode():
    case = harness.make_case(
        9, [(1, 30), (1, 3), (1, 17)], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=8
    )
    _check(case, max_q_len=1)


@pytest.mark.parametrize("broken", [harness.drop_one_key, harness.swap_kv])
def test_broken_input_is_rejected(broken):
    case = harness.make_case(13, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    expected = harness.dense_oracle(case, sm_scale=0.125)
    out, lse = rpa(*broken(case).args(), sm_scale=0.125)
    with pytest.raises(AssertionError, match="rows differ"):
        harness.assert_close_to_oracle(case, out, lse, expected)


def test_out_dtype_float32_is_the_unrounded_output():
    case = harness.make_case(
        3, MIXED, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=jnp.bfloat16
    )
    out, lse = rpa(*case.args(), sm_scale=0.125)
    out32, lse32 = rpa(*case.args(), sm_scale=0.125, out_dtype=jnp.float32)
    assert out.dtype == jnp.bfloat16 and out32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out32.astype(jnp.bfloat16)), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse32), np.asarray(lse))
    n = case.num_valid_tokens
    assert np.any(np.asarray(out32[:n]) != np.asarray(out[:n].astype(jnp.float32)))


def test_agrees_with_jax_reference():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_rpa

    for seed, (soft_cap, window) in enumerate([(None, None), (5.0, 6)]):
        case = harness.make_case(
            seed, MIXED[:3], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, poison=False
        )
        ours, _ = ragged_paged_attention(
            *case.args(), sm_scale=0.1, soft_cap=soft_cap, sliding_window=window
        )
        theirs = jax_rpa.ref_ragged_paged_attention(
            *case.args(), sm_scale=0.1, soft_cap=soft_cap, sliding_window=window
        )
        n = case.num_valid_tokens
        np.testing.assert_allclose(np.asarray(ours[:n]), np.asarray(theirs[:n]), atol=2e-5)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: {**a, "q": a["q"][0]}, "q.shape"),
        (lambda a: {**a, "kv_pages": a["kv_pages"][..., :3, :]}, "combined KV heads"),
        (lambda a: {**a, "kv_pages": a["kv_pages"][..., :32]}, "head_dim"),
        (lambda a: {**a, "kv_lens": a["kv_lens"].astype(jnp.float32)}, "kv_lens.dtype"),
        (lambda a: {**a, "cu_q_lens": a["cu_q_lens"][:-1]}, "cu_q_lens.shape"),
        (lambda a: {**a, "num_seqs": a["num_seqs"][:0]}, "num_seqs.shape"),
        (lambda a: {**a, "page_indices": a["page_indices"][:1]}, "page_indices.shape"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of num_kv_heads"),
        (lambda a: {**a, "kv_pages": a["kv_pages"].astype(jnp.int8)}, "k_scale and v_scale"),
        (lambda a: {**a, "q": a["q"].astype(jnp.int32)}, "q.dtype"),
        (lambda a: {**a, "kv_pages": a["kv_pages"].astype(jnp.int32)}, "kv_pages.dtype"),
        (lambda a: {**a, "kv_pages": a["kv_pages"][0]}, "kv_pages.shape"),
        (lambda a: {**a, "kv_lens": a["kv_lens"][:, None]}, "kv_lens.shape"),
        (lambda a: {**a, "page_indices": a["page_indices"][..., None]}, "page_indices.shape"),
        (lambda a: {**a, "page_indices": a["page_indices"].astype(jnp.int8)}, "page_indices.dtype"),
        (lambda a: {**a, "num_seqs": a["num_seqs"].astype(jnp.float32)}, "num_seqs.dtype"),
    ],
)
def test_bad_input_raises_at_trace_time(mutate, match):
    case = harness.make_case(0, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    names = ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
    args = mutate(dict(zip(names, case.args(), strict=True)))
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(ragged_paged_attention, sm_scale=1.0), **abstract)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"sm_scale": float("inf")}, "sm_scale=inf must be a finite number > 0"),
        ({"sm_scale": float("nan")}, "sm_scale=nan must be a finite number > 0"),
        ({"sm_scale": None}, "sm_scale=None must be a finite number > 0"),
        # Neither a number nor an array: left as given for the scale's own check.
        ({"sm_scale": "0.125"}, "sm_scale='0.125' must be a finite number > 0"),
        ({"causal": "no"}, "causal='no' must be a bool"),  # ran causal, by truthiness
        ({"causal": None}, "causal=None must be a bool"),  # ran non-causal
        ({"out_dtype": jnp.int32}, "out_dtype=.* must be None"),
        # No dtype at all: jnp.dtype's TypeError, naming nothing.
        ({"out_dtype": "no dtype"}, "out_dtype='no dtype' must be None"),
        ({"soft_cap": float("inf")}, "soft_cap=inf must be a finite number > 0"),
        ({"k_scale": float("nan"), "v_scale": 1.0}, "k_scale=nan must be a finite number"),
        ({"k_scale": 1.0, "v_scale": 0.0}, "v_scale=0.0 must be a finite number > 0"),
        # Finite in float64 but inf or 0 in the float32 the kernels scale in: NaN rows, or
        # every key weighted alike (as sm_scale=0 would, which is refused).
        ({"sm_scale": 1e39}, r"sm_scale=1e\+39 must be a finite number > 0 in float32"),
        ({"sm_scale": 1e-50}, "sm_scale=1e-50 must be a finite number > 0 in float32"),
        ({"soft_cap": 1e39}, r"soft_cap=1e\+39 must be a finite number > 0 in float32"),
        # A float32 subnormal is flushed to 0 on the device: soft_cap=1e-40 gave NaN rows
        # (0 / 0), sm_scale=1e-40 NaN rows on the GPU kernel.
        ({"soft_cap": 1e-40, "sm_scale": 1e-30}, "soft_cap=1e-40 must be .* not subnormal"),
        ({"sm_scale": 1e-40}, "sm_scale=1e-40 must be a finite number > 0 in float32, not subn"),
        ({"sm_scale": 1e-20, "k_scale": 1e-20, "v_scale": 1.0}, r"sm_scale \* k_scale = 1e-40"),
        # An int past float64's range: OverflowError from math.isfinite, naming nothing.
        ({"sm_scale": 10**400}, "sm_scale=10+ must be a finite number > 0 in float32"),
        ({"soft_cap": 10**400}, "soft_cap=10+ must be a finite number > 0 in float32"),
        ({"k_scale": 1.0, "v_scale": 1e39}, r"v_scale=1e\+39 must be a finite number > 0"),
        # Each finite alone, but a product the kernels fold into one float32 factor is
        # not: the GPU kernel's base-2 factor sm_scale * log2(e) was inf, its rows NaN.
        (
            {"sm_scale": 3e38},
            r"sm_scale \* log2\(e\) = 4.328e\+38 must be finite and normal in float32",
        ),
        ({"k_scale": 1e20, "v_scale": 1.0, "sm_scale": 1e20}, r"sm_scale \* k_scale = 1e\+40"),
        ({"soft_cap": 3e38}, r"soft_cap=3e\+38 must be at most 2\*\*100"),
        ({"sm_scale": 1e30, "soft_cap": 1e-10}, r"sm_scale / soft_cap = 1e\+40 must be finite"),
        ({"sliding_window": 2.5}, "sliding_window=2.5 must be an int"),
        ({"sliding_window": True}, "sliding_window=True must be an int"),
        ({"sliding_window": 0}, "sliding_window=0 must be >= 1"),  # would hide every key
        # Positions are int32: a longer window overflowed in jit's argument parsing.
        ({"sliding_window": 2**31}, r"sliding_window=2147483648 must be <= 2\*\*31 - 1"),
        ({"max_q_len": 0}, "max_q_len=0 must be >= 1"),
        ({"max_q_len": 2.0}, "max_q_len=2.0 must be an int"),
        ({"max_q_len": 11}, "sequence 4 has 12 query tokens, more than max_q_len=11"),
    ],
)
def test_bad_options_are_refused_by_name(options, match):
    # Each would give NaN or silently wrong rows (a query row past max_q_len gets none of
    # its attention), or fail deep inside a kernel.
    case = harness.make_case(0, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    options = {"sm_scale": 1.0, **options}
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*case.args(), **options)


@pytest.mark.parametrize("k_scale, v_scale", [(0.5, None), (None, 0.5)])
def test_quantized_kv_needs_both_scales(k_scale, v_scale):
    # One missing scale would read that side's integers unscaled: silently wrong.
    case = harness.make_case(0, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    args = list(case.args())
    args[1] = args[1].astype(jnp.int8)
    with pytest.raises(ValueError, match="k_scale and v_scale are required"):
        ragged_paged_attention(*args, sm_scale=1.0, k_scale=k_scale, v_scale=v_scale)


def test_zero_kv_heads_are_refused_by_name():
    case = harness.make_case(0, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    with pytest.raises(ValueError, match="combined KV heads .* positive even number"):
        ragged_paged_attention(case.q, case.kv_pages[:, :, :0], *case.args()[2:], sm_scale=1.0)


def test_sliding_window_needs_causal():
    case = harness.make_case(0, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    with pytest.raises(ValueError, match="sliding_window"):
        ragged_paged_attention(*case.args(), sm_scale=1.0, causal=False, sliding_window=4)


def test_a_batch_whose_sequences_have_no_queries_gives_only_padding_rows():
    # Every sequence holds keys but no query this step: there is no valid row to compare,
    # and the harness's row-by-row check must take that (it reshaped 0 rows and raised).
    case = harness.make_case(
        5, [(0, 7), (0, 16)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8
    )
    out, lse = rpa(*case.args(), sm_scale=0.125)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))
    harness.assert_padding_is_empty(case, out, lse)
