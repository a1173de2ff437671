"""paged_attention, write_kv and check_backend refuse bad arguments by name, at trace time.

A cache whose pages hold another number of tokens than the metadata's block_size used
to run without complaint under jit (slots and page counts addressed other keys); a bool
sm_scale scaled by 1; write_kv leaked unpacking, reshape and indexer errors; and
check_backend passed head_dim=-1, failed on block_size=0 with numpy's reduction error
and refused every quantized cache (its probe passed no scales).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.attention as attention
from jaxkv.attention import check_backend, kernel_for, paged_attention, write_kv
from jaxkv.batch import build_attention_metadata
from kernels_pallas.reference import ragged_paged_attention
from tests.attention.test_metadata_argument_checks import _three_decoding

H_Q, H_KV, D = 8, 2, 64


def _metadata():
    _, build = _three_decoding()  # block size 4, one cascade level
    return build_attention_metadata(**build)


def test_pages_of_another_block_size_or_no_metadata_are_refused():
    md = _metadata()
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages8 = jnp.zeros((64, 8, 2 * H_KV, D), jnp.float32)
    with pytest.raises(ValueError, match="must have pages of the metadata's .*block_size=4"):
        paged_attention(q, pages8, md, sm_scale=0.125)
    with pytest.raises(ValueError, match="metadata=dict must be an AttentionMetadata"):
        paged_attention(q, pages8, {"md": md}, sm_scale=0.125)


def test_a_cache_smaller_than_the_managers_pool_is_refused():
    """Under jit a page id past the cache is clamped to its last block: another block's
    keys and finite, wrong output. The metadata names its manager's pool size (64)."""
    md = _metadata()
    assert md.num_blocks == 64
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    for num_blocks in (32, 63):  # 63: one block short, the pool's last id past the cache
        small = jnp.zeros((num_blocks, 4, 2 * H_KV, D), jnp.float32)
        with pytest.raises(ValueError, match=r"must hold the 64 blocks of the pool"):
            jax.jit(lambda q, p, md: paged_attention(q, p, md, sm_scale=0.125))(q, small, md)
    pages = jnp.zeros((64, 4, 2 * H_KV, D), jnp.float32)
    assert paged_attention(q, pages, md, sm_scale=0.125).shape == q.shape


def test_a_cache_of_another_rank_is_refused_for_its_shape_not_its_pool():
    """A per-layer cache stacked into one array ([num_layers, num_blocks, ...]) has fewer
    rows than the pool on axis 0: it was refused as a pool too small for the metadata,
    which sends the caller looking for a smaller KVCacheManager, not for the layer index."""
    md = _metadata()
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    for shape in ((2, 64, 4, 2 * H_KV, D), (4, 2 * H_KV, D)):  # stacked layers; one page
        with pytest.raises(ValueError, match=r"must be \[num_blocks, block_size, 2 \* num_kv"):
            paged_attention(q, jnp.zeros(shape, jnp.float32), md, sm_scale=0.125)


def test_a_cache_query_or_kv_that_is_no_array_is_refused_by_name():
    # A list failed with AttributeError ('list' object has no attribute 'ndim'/'dtype').
    md = _metadata()
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages = jnp.zeros((64, 4, 2 * H_KV, D), jnp.float32)
    with pytest.raises(ValueError, match="q must be a numpy or jax array, not list"):
        paged_attention(np.asarray(q).tolist(), pages, md, sm_scale=0.125)
    with pytest.raises(ValueError, match="kv_pages must be a numpy or jax array, not list"):
        paged_attention(q, np.asarray(pages).tolist(), md, sm_scale=0.125)
    k = jnp.zeros((md.max_num_tokens, H_KV, D), jnp.float32)
    for name in ("kv_pages", "k", "v"):
        args = {"kv_pages": pages, "k": k, "v": k}
        args[name] = np.asarray(args[name]).tolist()
        with pytest.raises(ValueError, match=f"{name} must be a numpy or jax array, not list"):
            write_kv(args["kv_pages"], args["k"], args["v"], md.slot_mapping)


def test_64_bit_numpy_arrays_are_refused_by_name_before_jit_converts_them():
    # paged_attention's jit turned a float64 q into float32 and an int64 page table into
    # int32 without a word: page id 2**32 + 7 became block 7, another request's keys.
    md = _metadata()
    q = np.zeros((md.max_num_tokens, H_Q, D), np.float32)
    pages = np.zeros((64, 4, 2 * H_KV, D), np.float32)
    with pytest.raises(ValueError, match="q.dtype=float64 must be one of float32"):
        paged_attention(q.astype(np.float64), pages, md, sm_scale=0.125)
    with pytest.raises(ValueError, match="kv_pages.dtype=float64 must be one of float32"):
        paged_attention(q, pages.astype(np.float64), md, sm_scale=0.125)
    table = md.page_indices.astype(np.int64)
    table[0, 0] = 2**32 + 7
    wide = dataclasses.replace(md, page_indices=table)
    with pytest.raises(ValueError, match="metadata.page_indices.dtype=int64 must be int32"):
        paged_attention(q, pages, wide, sm_scale=0.125)
    level = dataclasses.replace(md.levels[0], kv_lens=md.levels[0].kv_lens.astype(np.int64))
    wide = dataclasses.replace(md, levels=(level,))
    with pytest.raises(ValueError, match=r"metadata.levels\[0\].kv_lens.dtype=int64 must be"):
        paged_attention(q, pages, wide, sm_scale=0.125)


def test_a_bool_scale_is_refused():
    md = _metadata()
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages = jnp.zeros((64, 4, 2 * H_KV, D), jnp.float32)
    with pytest.raises(ValueError, match="sm_scale=True must be a finite number > 0"):
        paged_attention(q, pages, md, sm_scale=True)
    with pytest.raises(ValueError, match="return_lse='no' must be a bool"):  # gave the tuple
        paged_attention(q, pages, md, sm_scale=0.125, return_lse="no")
    # Arrays failed with jax's "Non-hashable static arguments", naming no argument.
    for option, value in (("sliding_window", jnp.int32(4)), ("return_lse", jnp.bool_(True))):
        with pytest.raises(ValueError, match=f"{option}=.* must be a static"):
            paged_attention(q, pages, md, sm_scale=0.125, **{option: value})
    k = jnp.zeros((md.max_num_tokens, H_KV, D), jnp.float32)
    with pytest.raises(ValueError, match="k_scale=True"):
        write_kv(pages.astype(jnp.int8), k, k, md.slot_mapping, k_scale=True, v_scale=1.0)


@pytest.mark.parametrize(
    "pages_shape,slot_dtype,match",
    [
        ((64, 4, 4 * D), np.int32, r"kv_pages.shape=\(64, 4, 256\) must be \[num_blocks"),
        ((64, 4, 3, D), np.int32, r"kv_pages.shape=\(64, 4, 3, 64\) must be \[num_blocks"),
        ((64, 4, 0, D), np.int32, r"kv_pages.shape=\(64, 4, 0, 64\) must be \[num_blocks"),
        ((64, 4, 2 * H_KV, D), np.float32, "slot_mapping must be an integer array"),
    ],
    ids=["rank_3", "odd_heads", "no_heads", "float_slots"],
)
def test_write_kv_refuses_a_malformed_cache_or_slot_mapping_by_name(pages_shape, slot_dtype, match):
    k = jnp.zeros((8, H_KV, D), jnp.float32)
    with pytest.raises(ValueError, match=match):
        write_kv(jnp.zeros(pages_shape, jnp.float32), k, k, np.zeros(8, slot_dtype))


def test_write_kv_refuses_a_slot_mapping_of_another_token_count():
    k = jnp.zeros((8, H_KV, D), jnp.float32)
    with pytest.raises(ValueError, match=r"slot_mapping.shape=\(7,\) must be \(8,\)"):
        write_kv(jnp.zeros((64, 4, 2 * H_KV, D), jnp.float32), k, k, np.zeros(7, np.int32))


@pytest.mark.parametrize(
    "k_shape,v_shape",
    [((8, H_KV + 1, D), (8, H_KV + 1, D)), ((8, H_KV, D // 2), (8, H_KV, D // 2)),
     ((8, H_KV, D), (7, H_KV, D))],
    ids=["heads", "head_dim", "v_tokens"],
)  # fmt: skip
def test_write_kv_refuses_k_and_v_that_are_not_the_caches_heads_by_shape(k_shape, v_shape):
    # Another head count would write into the wrong combined heads, another head_dim
    # fail in the reshape naming nothing, and v of other tokens be stacked with k's.
    pages = jnp.zeros((64, 4, 2 * H_KV, D), jnp.float32)
    k, v = jnp.zeros(k_shape, jnp.float32), jnp.zeros(v_shape, jnp.float32)
    want = f"k.shape={k_shape} and v.shape={v_shape} must be [max_num_tokens, {H_KV}, {D}]"
    with pytest.raises(ValueError, match="^" + re.escape(want)):
        write_kv(pages, k, v, np.zeros(8, np.int32))


def test_write_kv_refuses_a_float64_numpy_cache_before_jit_converts_it():
    # jit turned it into a float32 cache without a word (refused with x64 on); an
    # int64 slot_mapping, narrowed by int32_slots, and float64 K and V, cast to the
    # cache's dtype anyway, are still taken.
    k = np.ones((8, H_KV, D), np.float64)
    pages = np.zeros((64, 4, 2 * H_KV, D), np.float64)
    with pytest.raises(ValueError, match="kv_pages.dtype=float64 must be float32, bfloat16"):
        write_kv(pages, k, k, np.arange(8, dtype=np.int64))
    with pytest.raises(ValueError, match="kv_pages.dtype=float64 must be float32, bfloat16"):
        write_kv(kv_pages=pages, k=k, v=k, slot_mapping=np.arange(8, dtype=np.int64))
    out = write_kv(jnp.asarray(pages, jnp.float32), k, k, np.arange(8, dtype=np.int64))
    assert out.dtype == jnp.float32 and float(out[0, 0, 0, 0]) == 1.0


SHAPES = dict(num_q_heads=H_Q, num_kv_heads=H_KV, head_dim=D, block_size=16)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(head_dim=-1), "head_dim=-1 must be an int >= 1"),
        (dict(head_dim=64.0), "head_dim=64.0 must be an int >= 1"),
        (dict(block_size=0), "block_size=0 must be an int >= 1"),
        (dict(num_kv_heads=True), "num_kv_heads=True must be an int >= 1"),
        (dict(interpret="yes"), "interpret='yes' must be a bool"),
        (dict(q_dtype="float33"), "q_dtype='float33' must be a dtype"),
        (dict(kv_dtype=None), "kv_dtype=None must be a dtype"),  # was named float64
        # A value of a dtype was taken for its dtype (jnp.dtype reads a value's).
        (dict(q_dtype=np.float32(1.0)), r"q_dtype=np.float32\(1.0\) must be a dtype"),
        (dict(kv_dtype=jnp.zeros(2, jnp.bfloat16)), "kv_dtype=Array.* must be a dtype"),
        # The probe's eval_shape made float64 float32 (x64 off), which paged_attention refuses.
        (dict(q_dtype=np.float64), "q_dtype=float64 must be one of float32, bfloat16"),
        (dict(kv_dtype="float64"), "kv_dtype=float64 must be one of float32, .*int8"),
        (dict(q_dtype=np.int32), "q_dtype=int32 must be one of float32, bfloat16"),
    ],
)
def test_check_backend_refuses_bad_sizes_and_dtypes_by_name(change, match):
    args = dict(SHAPES, interpret=False, q_dtype=jnp.float32, kv_dtype=jnp.float32)
    with pytest.raises(ValueError, match=match):
        check_backend("xla", **{**args, **change})


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_check_backend_accepts_a_quantized_cache(kv_dtype):
    # write_kv and paged_attention take such caches with k_scale and v_scale.
    check_backend("xla", interpret=False, q_dtype=jnp.float32, kv_dtype=kv_dtype, **SHAPES)


def test_check_backend_probes_the_non_causal_pass_of_cascade_levels(monkeypatch):
    # A cascade level runs the kernel with causal=False, which may pick other tiles (the
    # TPU kernel's non-causal query block): a limit only that pass hits must be named
    # here, not when the first cascade step runs.
    def causal_only(*args, causal, **options):
        if not causal:
            raise ValueError("no non-causal pass for these shapes")
        return ragged_paged_attention(*args, causal=causal, **options)

    monkeypatch.setattr(attention, "kernel_for", lambda *a, **kw: causal_only)
    attention._probe_kernel.cache_clear()  # a combination accepted earlier is not probed
    with pytest.raises(ValueError, match="no non-causal pass"):
        check_backend("xla", interpret=False, q_dtype=jnp.float32, kv_dtype=jnp.float32, **SHAPES)


def test_a_scale_given_as_a_scalar_array_is_the_same_number_and_a_traced_one_is_named():
    """1 / jnp.sqrt(head_dim) is a jax array, which jit's static options cannot hash:
    it used to fail with jax's "Non-hashable static arguments" naming no argument."""
    md = _metadata()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(md.max_num_tokens, H_Q, D)), jnp.float32)
    pages = jnp.asarray(rng.normal(size=(64, 4, 2 * H_KV, D)), jnp.float32)
    want = paged_attention(q, pages, md, sm_scale=0.125)
    for scale in (1 / jnp.sqrt(jnp.float32(D)), np.float32(0.125), np.array(0.125)):
        np.testing.assert_array_equal(paged_attention(q, pages, md, sm_scale=scale), want)
    with pytest.raises(ValueError, match="sm_scale=.* must be a single number"):
        paged_attention(q, pages, md, sm_scale=jnp.full((2,), 0.125))
    with pytest.raises(ValueError, match="sm_scale must be a static number, not a traced"):
        jax.jit(lambda s: paged_attention(q, pages, md, sm_scale=s))(0.125)
    with pytest.raises(ValueError, match="sm_scale=True must be a finite number > 0"):
        paged_attention(q, pages, md, sm_scale=np.bool_(True))
    for not_real in (np.str_("0.125"), np.array("0.125"), np.complex64(0.125 + 1j)):
        with pytest.raises(ValueError, match="sm_scale=.* must be a finite number > 0"):
            paged_attention(q, pages, md, sm_scale=not_real)  # the str was read as 0.125
    for copied in (copy.copy(paged_attention), copy.deepcopy(write_kv)):  # no recursion
        assert copied.__wrapped__ is not None
    k = jnp.ones((md.max_num_tokens, H_KV, D), jnp.float32)

    def int8_pages():  # write_kv donates the cache
        return jnp.zeros((64, 4, 2 * H_KV, D), jnp.int8)

    got = write_kv(int8_pages(), k, k, md.slot_mapping, k_scale=jnp.float32(0.5), v_scale=1.0)
    want = write_kv(int8_pages(), k, k, md.slot_mapping, k_scale=0.5, v_scale=1.0)
    np.testing.assert_array_equal(got, want)
    # A Fraction passed the scale check and then failed dividing k by it (TypeError).
    got = write_kv(int8_pages(), k, k, md.slot_mapping, k_scale=Fraction(1, 2), v_scale=1.0)
    np.testing.assert_array_equal(got, want)
    got = paged_attention(q, pages, md, sm_scale=Fraction(1, 8))
    np.testing.assert_array_equal(got, paged_attention(q, pages, md, sm_scale=0.125))


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_a_pallas_backend_called_outside_jit_off_its_platform_is_refused_by_name(backend):
    """It used to fail inside JAX's compile with an error naming neither the backend nor
    interpret. Under jit nothing is checked (tests/kernels lower such traces for TPU and
    GPU on this CPU)."""
    md = _metadata()
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages = jnp.zeros((64, 4, 2 * H_KV, D), jnp.float32)
    refused = f"backend='{backend}' compiles only on a .*interpret=True"
    if backend != f"pallas_{jax.default_backend()}":  # on its own platform it compiles
        with pytest.raises(ValueError, match=refused):
            paged_attention(q, pages, md, sm_scale=0.125, backend=backend, interpret=False)
    for bad in (0, "", "no"):  # JAX's own error, or interpreted by truthiness
        with pytest.raises(ValueError, match=f"interpret={bad!r} must be a bool or None"):
            paged_attention(q, pages, md, sm_scale=0.125, backend=backend, interpret=bad)
    with pytest.raises(ValueError, match="interpret='yes' must be a bool or None"):
        paged_attention(q, pages, md, sm_scale=0.125, backend="xla", interpret="yes")


@pytest.mark.parametrize("backend", ["xla", "pallas_gpu"])
def test_kernel_for_passes_max_q_len_to_the_kernel(backend):
    """The bound sizes the query layout of each pass: dropped, a cascade level holding a
    whole batch as one sequence is laid out for max_num_tokens rows."""
    assert kernel_for(backend, interpret=True, max_q_len=5).keywords["max_q_len"] == 5


def test_kernel_for_asks_the_tpu_for_its_tuning_only_when_compiling_on_one(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert kernel_for("pallas_tpu").keywords["tpu_generation"] == "auto"
    interpreted = kernel_for("pallas_tpu", interpret=True).keywords
    assert interpreted["tpu_generation"] == "default" and interpreted["interpret"] is True


def test_kernel_for_refuses_an_unknown_backend_by_name():
    with pytest.raises(ValueError, match="backend='cuda' must be one of"):
        kernel_for("cuda")


def test_a_max_q_len_below_a_pass_s_longest_query_is_refused_by_name():
    """The xla backend lays each sequence out in max_q_len rows: a hand-made metadata
    with a smaller bound gave the rows past it no attention, under paged_attention's jit
    (eager calls included), without an error."""
    i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    md = build_attention_metadata(**_three_decoding()[1])  # decodes; a level of 3 tokens
    md = dataclasses.replace(  # sequence 0 has 4 query tokens, sequence 1 two
        md, cu_q_lens=i32([0, 4, 6, 6, 6]), kv_lens=i32([8, 8, 0, 0]), num_seqs=i32([2]),
        levels=(), max_q_len=4,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((md.max_num_tokens, H_Q, D)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((64, 4, 2 * H_KV, D)), jnp.float32)
    assert np.isfinite(np.asarray(paged_attention(q, pages, md, sm_scale=0.125))).all()
    short = dataclasses.replace(md, max_q_len=2)
    match = r"metadata\.max_q_len=2 must be at least .*sequence 0 has 4 query tokens"
    with pytest.raises(ValueError, match=match):
        paged_attention(q, pages, short, sm_scale=0.125)
    with pytest.raises(ValueError, match=match):  # closed over by jit: still concrete
        jax.jit(lambda q: paged_attention(q, pages, short, sm_scale=0.125))(q)
    level_md = _metadata()
    level = dataclasses.replace(level_md.levels[0], max_q_len=2)  # its group holds 3 tokens
    with pytest.raises(ValueError, match=r"metadata\.levels\[0\]\.max_q_len=2 must be"):
        paged_attention(q, pages, dataclasses.replace(level_md, levels=(level,)), sm_scale=0.125)


def _hand_made_two_sequences(cu_q_lens: list[int], max_q_len: int):
    """A hand-made metadata (no pool size: num_blocks None) of two valid sequences of 8
    keys over pages 1 and 2, no levels, with these query bounds."""
    i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    return dataclasses.replace(
        _metadata(), cu_q_lens=i32(cu_q_lens), kv_lens=i32([8, 8, 0, 0]),
        page_indices=i32(np.tile([[1, 2]], (4, 1))), num_seqs=i32([2]), levels=(),
        max_q_len=max_q_len, num_blocks=None,
    )  # fmt: skip


def test_index_values_of_a_hand_made_metadata_are_checked_outside_jit():
    """paged_attention runs its kernels under jit, where they cannot see the values: a
    page id past the cache read a clamped page, a kv_len past its pages other keys, out
    of range cu_q_lens other tokens, all without an error."""
    i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    md = _hand_made_two_sequences(cu_q_lens=[0, 4, 6, 6, 6], max_q_len=4)
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages = jnp.zeros((3, 4, 2 * H_KV, D), jnp.float32)
    assert paged_attention(q, pages, md, sm_scale=0.125).shape == q.shape
    bad = {
        "page_indices": (i32([[1, 2], [1, 7], [0, 0], [0, 0]]), r"page_indices\[1, 1\]=7 must"),
        "kv_lens": (i32([8, 9, 0, 0]), r"kv_lens\[1\]=9 must be in \[0, 8\]"),
        "cu_q_lens": (i32([0, 4, 3, 6, 6]), r"cu_q_lens\[2\]=3 must be in \[4,"),
    }
    for field, (value, match) in bad.items():
        with pytest.raises(ValueError, match=rf"^metadata: {match}"):
            paged_attention(q, pages, dataclasses.replace(md, **{field: value}), sm_scale=0.125)
    level_md = _metadata()
    level = level_md.levels[0]
    level = dataclasses.replace(level, page_indices=np.full_like(level.page_indices, 64))
    with pytest.raises(ValueError, match=r"^metadata\.levels\[0\]: page_indices\[0, 0\]=64"):
        pages64 = jnp.zeros((64, 4, 2 * H_KV, D), jnp.float32)
        paged_attention(q, pages64, dataclasses.replace(level_md, levels=(level,)), sm_scale=0.125)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_seqs": [7]}, r"^metadata: num_seqs\[0\]=7 must be in \[0, max_num_seqs=4\]"),
        ({"num_seqs": [-1]}, r"^metadata: num_seqs\[0\]=-1 must be in"),
        ({"num_seqs": 2}, r"num_seqs.shape=\(\) must be \(1,\)"),
        ({"num_seqs": [2, 2]}, r"num_seqs.shape=\(2,\) must be \(1,\)"),
        ({"cu_q_lens": [[0, 4, 6, 6, 6]]}, r"cu_q_lens.shape=\(1, 5\) must be \(5,\)"),
        ({"max_q_len": "2"}, r"max_q_len='2' must be an int >= 1"),
    ],
)
def test_malformed_index_arrays_are_named_not_read_for_the_query_bound(change, match):
    # The bound check reads only a well-formed pass (and its longest query is short of
    # max_q_len=2 here); a malformed one is left to the kernels' checks, which name it:
    # read, num_seqs=() raised numpy's IndexError, max_q_len='2' a TypeError, and an out
    # of range count was refused as a max_q_len below queries past the valid sequences.
    i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
    # two valid sequences of 2 query tokens, two of 2 more past them
    md = _hand_made_two_sequences(cu_q_lens=[0, 2, 4, 8, 12], max_q_len=2)
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages = jnp.zeros((3, 4, 2 * H_KV, D), jnp.float32)
    assert paged_attention(q, pages, md, sm_scale=0.125).shape == q.shape
    change = {k: v if k == "max_q_len" else i32(v) for k, v in change.items()}
    with pytest.raises(ValueError, match=match):
        paged_attention(q, pages, dataclasses.replace(md, **change), sm_scale=0.125)


@pytest.mark.parametrize("levels", [None, ({"max_q_len": 8},)], ids=["none", "dict"])
def test_levels_that_are_no_level_metadata_are_refused_by_name(levels):
    # None failed with "'NoneType' object is not iterable", a dict with AttributeError.
    md = dataclasses.replace(_metadata(), levels=levels)
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages = jnp.zeros((64, 4, 2 * H_KV, D), jnp.float32)
    with pytest.raises(ValueError, match=r"metadata\.levels=.* must be a tuple of LevelMetadata"):
        paged_attention(q, pages, md, sm_scale=0.125)
