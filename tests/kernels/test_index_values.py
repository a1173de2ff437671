"""Index values no kernel can honour are refused eagerly, by name, on every backend.

An out-of-range page id sends the TPU kernel's DMA outside kv_pages, and the reference and
the GPU kernel clamp it to some other page: a silently wrong answer at best. A kv_len
longer than its page-table row, a num_seqs past max_num_seqs or a cu_q_lens that falls
back or runs past the token rows are the same class of mistake. Called on concrete
arrays, every public entry point raises ValueError naming the argument before it traces
or runs anything; under jit (traced values) only the static checks apply. Entries no
valid sequence reads (padding) may hold anything.
"""

from __future__ import annotations

import functools
from decimal import Decimal
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import reference
from kernels_pallas.gpu import ragged_paged_attention as gpu_kernel
from kernels_pallas.tpu import ragged_paged_attention as tpu_kernel
from kernels_pallas.validation import checks_index_values
from tests.kernels import harness

SEQ_LENS = [(3, 20), (1, 9)]
# 2 valid sequences in a bucket of 3, 8 token rows, 2 pages of 16 per row, 6 pages.
SHAPES = dict(max_num_seqs=3, max_num_tokens=8, pages_per_seq=2, num_pages=6)

BACKENDS = {
    "reference": reference.ragged_paged_attention,
    "tpu": functools.partial(tpu_kernel, interpret=harness.INTERPRET_TPU),
    "gpu": functools.partial(gpu_kernel, interpret=harness.INTERPRET_GPU),
}


def _case() -> harness.Case:
    return harness.make_case(
        0, SEQ_LENS, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16, **SHAPES
    )


def _set(array: jax.Array, index, value) -> jax.Array:
    out = np.asarray(array).copy()
    out[index] = value
    return jnp.asarray(out)


# (name, field, index, value, message fragment): each breaks one value of the case.
BREAKAGES = [
    ("page_past_num_pages", "page_indices", (0, 1), 6, r"page_indices\[0, 1\]=6"),
    ("negative_page", "page_indices", (1, 0), -1, r"page_indices\[1, 0\]=-1"),
    ("kv_len_past_its_pages", "kv_lens", 0, 33, r"kv_lens\[0\]=33"),
    ("negative_kv_len", "kv_lens", 1, -1, r"kv_lens\[1\]=-1 must be in \[0, 32\]"),
    ("num_seqs_past_max", "num_seqs", 0, 4, r"num_seqs\[0\]=4"),
    ("negative_num_seqs", "num_seqs", 0, -1, r"num_seqs\[0\]=-1"),
    ("negative_first_offset", "cu_q_lens", 0, -1, r"cu_q_lens\[0\]=-1"),
    ("first_offset_not_zero", "cu_q_lens", 0, 1, r"cu_q_lens\[0\]=1 must be 0"),
    ("cu_q_lens_falls_back", "cu_q_lens", 1, 5, r"cu_q_lens\[2\]=4"),
    ("cu_q_lens_past_tokens", "cu_q_lens", 2, 9, r"cu_q_lens\[2\]=9"),
    ("causal_kv_len_below_q_len", "kv_lens", 0, 2, r"kv_lens\[0\]=2 .* query length 3"),
]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    "field, index, value, match", [b[1:] for b in BREAKAGES], ids=[b[0] for b in BREAKAGES]
)
def test_bad_index_values_raise_by_name(backend, field, index, value, match):
    case = _case()
    case = case.replace(**{field: _set(getattr(case, field), index, value)})
    with pytest.raises(ValueError, match=match):
        BACKENDS[backend](*case.args(), sm_scale=0.125)


@pytest.mark.parametrize("backend", [*sorted(BACKENDS), "cascade"])
@pytest.mark.parametrize(
    "name", ["q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"]
)
def test_an_argument_that_is_no_array_is_refused_by_name(backend, name):
    # A list failed with an AttributeError ('list' object has no attribute 'ndim') or,
    # in cascade_attention, a TypeError from its arithmetic, naming no argument.
    names = ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
    args = dict(zip(names, _case().args(), strict=True))
    args[name] = np.asarray(args[name]).tolist()
    if backend == "cascade":
        fn = functools.partial(reference.cascade_attention, num_prefix_pages=0)
    else:
        fn = BACKENDS[backend]
    with pytest.raises(ValueError, match=f"{name} must be a numpy or jax array, not list"):
        fn(**args, sm_scale=0.125)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_unread_entries_may_hold_anything(backend):
    # Past each valid row's pages, in the padded row and past num_seqs + 1 in cu_q_lens:
    # values out of every range, which no valid sequence reads.
    case = _case()
    table = np.asarray(case.page_indices).copy()
    table[1, 1] = 10**6  # sequence 1 (9 keys) reads only its first page
    table[2] = -7  # the padded sequence row
    kv_lens = _set(case.kv_lens, 2, 10**6)
    cu_q_lens = _set(case.cu_q_lens, 3, -5)
    case = case.replace(page_indices=jnp.asarray(table), kv_lens=kv_lens, cu_q_lens=cu_q_lens)
    out, lse = BACKENDS[backend](*case.args(), sm_scale=0.125, out_dtype=jnp.float32)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))


def test_unread_entries_may_hold_anything_in_numpy_arrays():
    # The reference runs eagerly: numpy arguments must not be indexed by numpy, which
    # raises IndexError for an unread page id past kv_pages instead of clamping it.
    case = _case()
    table = np.asarray(case.page_indices).copy()
    table[1, 1] = 10**6
    table[2] = 10**6
    case = case.replace(page_indices=jnp.asarray(table))
    args = tuple(np.asarray(a) for a in case.args())
    out, lse = reference.ragged_paged_attention(*args, sm_scale=0.125, out_dtype=jnp.float32)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_values_at_their_bounds_are_accepted(backend):
    # Every sequence slot used, the last token row used, a kv_len filling its whole
    # page-table row and the last page id of kv_pages: each on the edge of its range.
    case = harness.make_case(
        1, [(3, 32), (1, 9), (4, 4)], num_q_heads=2, num_kv_heads=1, head_dim=64,
        page_size=16, **SHAPES,
    )  # fmt: skip
    num_pages = SHAPES["num_pages"]
    assert num_pages - 1 in np.asarray(case.page_indices)
    out, lse = BACKENDS[backend](*case.args(), sm_scale=0.125, out_dtype=jnp.float32)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))


def test_non_causal_queries_may_outnumber_keys():
    # A cascade prefix pass: every query token of the batch over a short shared prefix.
    # The entry points' check takes `causal` from their options.
    case = _case()
    case = case.replace(kv_lens=_set(case.kv_lens, 0, 2))
    checked = checks_index_values(lambda *args, **options: "ran")
    assert checked(*case.args(), sm_scale=0.125, causal=False) == "ran"
    with pytest.raises(ValueError, match="query length"):
        checked(*case.args(), sm_scale=0.125)


@pytest.mark.parametrize("traced", ["kv_lens", "page_indices", "cu_q_lens", "num_seqs"])
def test_partly_traced_index_arrays_are_not_checked(traced):
    # The other index arrays concrete, closed over by a function traced in one alone: the
    # values are not all known, so nothing is converted to numpy.
    case = _case()

    def attend(value):
        args = case.replace(**{traced: value}).args()
        return reference.ragged_paged_attention(*args, sm_scale=0.125)

    out, _ = jax.eval_shape(attend, getattr(case, traced))
    assert out.shape == case.q.shape


def test_traced_values_are_not_checked():
    # Inside jit the values are unknown: only the static checks run (no concretization
    # error), and the kernel's in-range clamps keep the page read inside kv_pages.
    case = _case()
    case = case.replace(kv_lens=_set(case.kv_lens, 0, 33))
    jitted = jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=0.125))
    out, _ = jitted(*case.args())
    assert out.shape == case.q.shape


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_scale_given_as_a_jax_scalar_is_that_number(backend):
    # A jax array cannot be hashed as a static option; each entry point takes its value.
    case = _case()
    out, lse = BACKENDS[backend](*case.args(), sm_scale=jnp.float32(0.125), out_dtype=jnp.float32)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))


@pytest.mark.parametrize(
    "sm_scale, soft_cap",
    [(Fraction(1, 8), Fraction(5)), (Decimal("0.125"), Decimal(5))],
    ids=["fraction", "decimal"],
)
def test_scales_given_as_fractions_or_decimals_are_each_that_number(sm_scale, soft_cap):
    # Each passed the finite > 0 check and then failed with a TypeError naming nothing
    # where the kernel multiplied an array by it.
    case = _case()
    options = dict(sm_scale=sm_scale, soft_cap=soft_cap, out_dtype=jnp.float32)
    out, lse = reference.ragged_paged_attention(*case.args(), **options)
    want = harness.dense_oracle(case, sm_scale=0.125, soft_cap=5.0)
    harness.assert_close_to_oracle(case, out, lse, want)
    for bad in (Fraction(10**400), Decimal("sNaN"), Decimal("Infinity"), Fraction(1, 10**50)):
        with pytest.raises(ValueError, match="^sm_scale=.* must be a finite number > 0"):
            reference.ragged_paged_attention(*case.args(), sm_scale=bad)


def test_several_scales_given_as_scalar_arrays_are_each_that_number():
    # Each array option is converted, not only the first: a jax array left among the
    # static options failed with jax's "Non-hashable static arguments".
    case = _case()
    options = dict(sm_scale=jnp.float32(0.125), soft_cap=jnp.float32(5.0), out_dtype=jnp.float32)
    out, lse = reference.ragged_paged_attention(*case.args(), **options)
    want = harness.dense_oracle(case, sm_scale=0.125, soft_cap=5.0)
    harness.assert_close_to_oracle(case, out, lse, want)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    "option, value",
    [
        ("sliding_window", jnp.int32(4)),
        ("causal", jnp.bool_(True)),
        ("sliding_window", np.array(4)),
    ],
    ids=["jax_window", "jax_causal", "numpy_window"],
)
def test_an_option_given_as_an_array_is_refused_by_name(backend, option, value):
    # The Pallas kernels failed with jax's "Non-hashable static arguments", naming no
    # argument; the reference named it already.
    with pytest.raises(ValueError, match=f"{option}=.* must be"):
        BACKENDS[backend](*_case().args(), sm_scale=0.125, **{option: value})


def _cascade_case(shared: bool) -> harness.Case:
    """Two sequences whose queries all lie past their first page; `shared`: both rows
    start with the same page (the oracle walks each row, so it sees the sharing)."""
    case = harness.make_case(
        2, [(3, 20), (1, 30)], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16,
        **SHAPES,
    )  # fmt: skip
    if shared:
        case = case.replace(page_indices=_set(case.page_indices, (1, 0), case.page_indices[0, 0]))
    return case


@pytest.mark.parametrize(
    "num_prefix_pages, match",
    [
        (1, r"page_indices\[1, 0\]=\d+ must equal page_indices\[0, 0\]=\d+: num_prefix_pages=1"),
        (2, r"sequence 0's first query position 17 lies inside the 32 tokens"),
        (3, r"num_prefix_pages=3 must be in \[0, pages_per_seq=2\]"),
        (-1, r"num_prefix_pages=-1 must be in \[0, pages_per_seq=2\]"),
        (1.0, r"num_prefix_pages=1.0 must be one integer"),
    ],
)
def test_cascade_refuses_a_prefix_its_sequences_do_not_share(num_prefix_pages, match):
    # Unchecked, the prefix pass would show sequence 1 sequence 0's first page, or a query
    # keys after itself: wrong rows, no error.
    with pytest.raises(ValueError, match=match):
        reference.cascade_attention(*_cascade_case(False).args(), num_prefix_pages, sm_scale=0.125)


def test_cascade_refuses_a_prefix_count_of_two_dimensions_by_name():
    # Shape (1, 1) passed as one integer, then broadcast the suffix page table a rank up:
    # the error named kv_lens.shape=(1, 3).
    with pytest.raises(ValueError, match=r"num_prefix_pages=.* must be one integer \(a scalar"):
        reference.cascade_attention(
            *_cascade_case(True).args(), np.ones((1, 1), np.int32), sm_scale=0.125
        )


def test_cascade_takes_a_shared_prefix_and_skips_rows_without_queries():
    case = _cascade_case(True)
    expected = harness.dense_oracle(case, sm_scale=0.125)
    for prefix in (1, jnp.int32(1), np.int64(1), jnp.ones((1,), jnp.int32)):
        out, lse = reference.cascade_attention(*case.args(), prefix, sm_scale=0.125)
        harness.assert_close_to_oracle(case, out, lse, expected)
    # A sequence without query tokens gives no row: it need not hold the prefix. (Page 5
    # was sequence 0's first page, so setting it there changed nothing.)
    other = 4
    assert int(case.page_indices[0, 0]) != other
    case = case.replace(
        page_indices=_set(case.page_indices, (1, 0), other),
        cu_q_lens=_set(case.cu_q_lens, 2, 3),
        seq_lens=((3, 20), (0, 30)),
    )
    out, lse = reference.cascade_attention(*case.args(), 1, sm_scale=0.125)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))


def test_cascade_takes_a_row_without_queries_whose_context_is_shorter_than_the_prefix():
    # Its suffix pass has no keys: a negative suffix kv_len would be refused as an index
    # value, although the row reads nothing.
    case = _cascade_case(True)
    case = case.replace(
        kv_lens=_set(case.kv_lens, 1, 5), cu_q_lens=_set(case.cu_q_lens, 2, 3),
        seq_lens=((3, 20), (0, 5)),
    )  # fmt: skip
    out, lse = reference.cascade_attention(*case.args(), 1, sm_scale=0.125)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))


def test_cascade_refuses_a_first_query_on_the_prefix_last_key_by_name():
    # Position 15 is the last key of a 16-token prefix: the precondition's own message,
    # not a later refusal of the suffix pass's arguments.
    case = _cascade_case(True)
    case = case.replace(kv_lens=_set(case.kv_lens, 0, 18), seq_lens=((3, 18), (1, 30)))
    with pytest.raises(ValueError, match="sequence 0's first query position 15 lies inside"):
        reference.cascade_attention(*case.args(), 1, sm_scale=0.125)
    case = case.replace(kv_lens=_set(case.kv_lens, 0, 19), seq_lens=((3, 19), (1, 30)))
    out, lse = reference.cascade_attention(*case.args(), 1, sm_scale=0.125)
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=0.125))


def test_cascade_takes_a_prefix_of_every_page_when_no_row_has_queries():
    # num_prefix_pages may equal pages_per_seq (the bound is inclusive): only a batch
    # without query tokens satisfies the precondition then, and it gives empty rows.
    case = _cascade_case(True)
    case = case.replace(cu_q_lens=jnp.zeros_like(case.cu_q_lens), seq_lens=((0, 20), (0, 30)))
    out, lse = reference.cascade_attention(*case.args(), SHAPES["pages_per_seq"], sm_scale=0.125)
    harness.assert_padding_is_empty(case, out, lse)


@pytest.mark.parametrize("num_seqs", [0, 1])
def test_cascade_without_query_tokens_reads_no_prefix_page(num_seqs):
    # With no query token the precondition holds for any prefix, and row 0's prefix
    # pages may be padding (no sequence, or sequence 0 reads only its first page): the
    # prefix pass still asked for num_prefix_pages * page_size keys of row 0 and refused
    # them as page_indices[0, 1]=-1, naming a kv_lens[0] the caller never passed.
    case = _cascade_case(True)
    page_indices = np.full(case.page_indices.shape, -1, np.int32)
    page_indices[0, 0] = case.page_indices[0, 0]
    kv_lens = np.zeros_like(case.kv_lens)
    kv_lens[0] = 5
    case = case.replace(
        page_indices=jnp.asarray(page_indices), kv_lens=jnp.asarray(kv_lens),
        cu_q_lens=jnp.zeros_like(case.cu_q_lens), num_seqs=jnp.asarray([num_seqs], jnp.int32),
        seq_lens=((0, 5),)[:num_seqs],
    )  # fmt: skip
    out, lse = reference.cascade_attention(*case.args(), SHAPES["pages_per_seq"], sm_scale=0.125)
    harness.assert_padding_is_empty(case, out, lse)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    "name, dtype",
    [("q", np.float64), ("kv_pages", np.float64), ("kv_lens", np.int64),
     ("page_indices", np.int64), ("cu_q_lens", np.int64), ("num_seqs", np.int64)],
)  # fmt: skip
def test_a_64_bit_numpy_array_is_refused_by_name_as_given(backend, name, dtype):
    # jit turned a numpy float64 q into float32 and an int64 page table into int32 (values
    # past int32 wrapped) without a word, where the eager reference refused them: the
    # compiled kernels took what the reference did not. Every entry point now checks the
    # dtypes of its arguments as given, before its jit.
    names = ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
    args = dict(zip(names, _case().args(), strict=True))
    args[name] = np.asarray(args[name]).astype(dtype)
    with pytest.raises(ValueError, match=f"{name}.dtype=.*{np.dtype(dtype).name}.* must be"):
        BACKENDS[backend](**args, sm_scale=0.125)
    with jax.enable_x64(True):  # the same refusal where jit keeps 64-bit types
        with pytest.raises(ValueError, match=f"{name}.dtype=.*{np.dtype(dtype).name}.* must be"):
            BACKENDS[backend](**args, sm_scale=0.125)


@pytest.mark.parametrize("x64", [False, True])
def test_cascade_refuses_an_int64_kv_lens_by_name_with_x64_on_or_off(x64):
    # Its passes get kv_lens - prefix_len: int32 with x64 off, so an int64 kv_lens was
    # taken, where with x64 on the pass refused it (and an int64 page table always).
    case = _case()
    args = [np.asarray(a) for a in case.args()]
    args[2] = args[2].astype(np.int64)
    with jax.enable_x64(x64):
        with pytest.raises(ValueError, match="kv_lens.dtype=int64 must be int32"):
            reference.cascade_attention(*args, num_prefix_pages=0, sm_scale=0.125)
