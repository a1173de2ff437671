"""The Pallas GPU (Triton) ragged paged attention kernel against the dense oracle.

Every case runs the kernel in interpret mode off a GPU (on the CPU) and compiled on a GPU
(harness.INTERPRET_GPU). Each distinct static shape costs one compile of a few seconds,
so cases are tiny and the broken-input checks reuse the compiled program of the case
they break.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import reference
from kernels_pallas.gpu import cuda_lowering_target, ragged_paged_attention
from kernels_pallas.gpu.aot import lower_triton_calls
from kernels_pallas.gpu.tuning import default_config
from kernels_pallas.precision import compute_dtype
from tests.kernels import harness

SM_SCALE = 0.125


def _run(case: harness.Case, **kw):
    return ragged_paged_attention(
        *case.args(), sm_scale=SM_SCALE, interpret=harness.INTERPRET_GPU, **kw
    )


def _check(case: harness.Case, *, oracle_kw=None, **kernel_kw):
    """Runs the kernel, compares with the oracle and checks padding rows; returns outputs."""
    oracle_kw = oracle_kw or {}
    out, lse = _run(case, **oracle_kw, **kernel_kw)
    expected = harness.dense_oracle(case, sm_scale=SM_SCALE, **oracle_kw)
    harness.assert_close_to_oracle(case, out, lse, expected)
    harness.assert_padding_is_empty(case, out, lse)
    return expected


def _case(seq_lens, *, dtype=jnp.float32, head_dim=64, page_size=16, heads=(8, 2), **kw):
    return harness.make_case(
        0,
        seq_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        **kw,
    )


def test_decode_with_kv_splits_and_broken_inputs_fail():
    # 4 splits over at most 3 key blocks of 32: some splits are empty and must weigh 0.
    # Nine sequences: each program's binary search over cu_q_lens needs all its steps.
    case = _case([(1, 37), (1, 16), (1, 70), (1, 1), (1, 5), (1, 33), (1, 17), (1, 2), (1, 48)])
    knobs = {"num_kv_splits": 4, "block_k": 32}
    expected = _check(case, **knobs)
    for broken in (harness.drop_one_key(case), harness.swap_kv(case)):
        out, lse = _run(broken, **knobs)
        with pytest.raises(AssertionError, match="differ from the oracle"):
            harness.assert_close_to_oracle(case, out, lse, expected)
    # No valid sequence: every row is padding (same shapes, so no new compile).
    out, lse = _run(case.replace(num_seqs=jnp.zeros((1,), jnp.int32)), **knobs)
    assert np.all(np.asarray(out) == 0.0) and np.all(np.isneginf(np.asarray(lse)))


def test_decode_bf16_head_dim_128_single_split_mqa():
    case = _case([(1, 40), (1, 17), (1, 64)], dtype=jnp.bfloat16, head_dim=128, heads=(8, 1))
    _check(case, num_kv_splits=1)


def test_prefill_several_query_blocks_per_sequence_odd_group():
    # 3 query heads per KV head in 16-row blocks: 5 tokens (15 rows) per block, so the
    # 20-token sequence needs 4 blocks and one row of every block stays unused.
    _check(_case([(20, 20), (9, 9), (3, 30)], heads=(6, 2)), block_m=16, block_k=16)


def test_mixed_bf16_page_size_32_with_empty_sequence():
    case = _case([(1, 37), (5, 20), (0, 12), (12, 40)], dtype=jnp.bfloat16, page_size=32)
    _check(case)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_bf16_with_float32_out_is_the_unrounded_output(num_kv_splits):
    # What a cascade pass asks for: the same result before its rounding to bfloat16.
    # Key blocks of 16, so that two splits each hold keys and are merged unrounded.
    case = _case([(1, 37), (5, 20), (1, 60)], dtype=jnp.bfloat16)
    knobs = dict(num_kv_splits=num_kv_splits, block_k=16)
    out, lse = _run(case, **knobs)
    out32, lse32 = _run(case, **knobs, out_dtype=jnp.float32)
    assert out.dtype == jnp.bfloat16 and out32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out32.astype(jnp.bfloat16)), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse32), np.asarray(lse))
    n = case.num_valid_tokens
    assert np.any(np.asarray(out32[:n]) != np.asarray(out[:n].astype(jnp.float32)))
    harness.assert_close_to_oracle(
        case, out32, lse32, harness.dense_oracle(case, sm_scale=SM_SCALE)
    )


@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [(jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.float16), (jnp.float16, jnp.float32)],
    ids=["bf16-f32", "bf16-f16", "f16-f32"],
)
def test_queries_narrower_than_the_cache_compute_in_the_wider_dtype(dtype, kv_dtype):
    # bfloat16 queries rounded K, V (float32, or float16's longer mantissa) and the
    # softmax weights to bfloat16: outputs 4.9e-3 off the float64 oracle over a float32
    # cache, 5.2e-3 over a float16 one (lse 1.5e-3, 1.6e-3). Both dots now run in
    # float32 (jnp.promote_types of the two; float16 queries already did): 4e-7 off, each
    # split and their merge within float32's tolerance with out_dtype float32.
    case = _case([(1, 37), (5, 20), (1, 60)], dtype=dtype, kv_dtype=kv_dtype)
    expected = harness.dense_oracle(case, sm_scale=SM_SCALE)
    for num_kv_splits in (1, 2):
        knobs = dict(num_kv_splits=num_kv_splits, block_k=16)
        out32, lse32 = _run(case, **knobs, out_dtype=jnp.float32)
        harness.assert_close_to_oracle(case, out32, lse32, expected, dtype=jnp.float32)
        harness.assert_padding_is_empty(case, out32, lse32)
        out, _ = _run(case, **knobs)
        np.testing.assert_array_equal(np.asarray(out32.astype(dtype)), np.asarray(out))


def test_large_logits_stay_finite_in_each_split_and_in_their_merge():
    # Logits (and so each split's lse) of a few hundred, where exp overflows float32: the
    # online softmax and the merge of splits must both subtract their maximum. Float32
    # logits that large carry about 1e-4 of rounding, hence the wider bounds.
    case = harness.scale_queries(_case([(1, 37), (5, 20), (1, 60)]), 100.0)
    out, lse = _run(case, num_kv_splits=2, block_k=16)
    expected = harness.dense_oracle(case, sm_scale=SM_SCALE)
    harness.assert_close_to_oracle(case, out, lse, expected, atol=2e-4, rtol=2e-4, lse_atol=1e-4)


@pytest.mark.parametrize("logit", [-8e26, -8e29, -4e37])
def test_keys_whose_logits_are_all_hugely_negative_are_still_seen(logit):
    # A running max started at -1e30 (base 2) never rose for rows whose every logit lay
    # below it: they came back as seeing no key (out 0, lse -inf).
    page_size, head_dim = 16, 64
    kv = np.zeros((3, page_size, 2, head_dim), np.float32)  # 1 KV head: keys, values
    kv[1, :, 0] = 1.0
    kv[1, :, 1] = np.arange(page_size, dtype=np.float32)[:, None]  # value j = j
    q = np.full((1, 2, head_dim), logit / (head_dim * SM_SCALE), np.float32)
    args = (q, kv, [8], [[1]], [0, 1], [1])  # one query, 8 keys on page 1
    out, lse = ragged_paged_attention(
        *(jnp.asarray(a) for a in args), sm_scale=SM_SCALE, interpret=harness.INTERPRET_GPU
    )
    np.testing.assert_allclose(np.asarray(out), 3.5, rtol=1e-6)  # the mean of values 0..7
    # lse is the logit (+ log(8), below float32 resolution there) up to the rounding of
    # the q.k sum of head_dim float32 products, whose order follows the CPU's vector width:
    # at most head_dim * 2**-24 = 3.8e-6 relative.
    np.testing.assert_allclose(np.asarray(lse), logit, rtol=1e-5)


@pytest.mark.parametrize("logit", [3e38, -3e38, 2.5e38])
def test_logits_past_float32_max_over_log2e_stay_finite(logit):
    # The kernel scaled each logit by log2(e) before subtracting the row max: past
    # float32 max / log2(e) (2.36e38) that gave inf, and a row of NaN (or, negative, a row
    # that saw no key), where the reference is finite. sm_scale 1 keeps q.k itself finite.
    page_size, head_dim = 16, 16
    kv = np.zeros((3, page_size, 2, head_dim), np.float32)  # 1 KV head: keys, values
    kv[1, :, 0] = 1.0
    kv[1, :, 1] = np.arange(page_size, dtype=np.float32)[:, None]  # value j = j
    q = np.full((1, 2, head_dim), logit / head_dim, np.float32)
    args = [jnp.asarray(a) for a in (q, kv, [8], [[1]], [0, 1], [1])]  # 8 keys on page 1
    for soft_cap in (None, 2.0**100):  # the largest cap accepted (SOFT_CAP_MAX)
        kw = dict(sm_scale=1.0, soft_cap=soft_cap)
        out, lse = ragged_paged_attention(*args, **kw, interpret=harness.INTERPRET_GPU)
        ref_out, ref_lse = reference.ragged_paged_attention(*args, **kw)
        np.testing.assert_allclose(np.asarray(out), 3.5, rtol=1e-6)  # mean of values 0..7
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5)
        assert np.isfinite(np.asarray(lse)).all()


def test_prefix_pass_non_causal():
    # The cascade prefix pass: one sequence holds every query token, all keys visible.
    # The second sequence is a level's gap: query tokens and no key, so both of its KV
    # splits are empty and the merge must give out 0 and lse -inf, not NaN.
    case = _case([(7, 48), (3, 3)])
    case = case.replace(kv_lens=case.kv_lens.at[1].set(0), seq_lens=((7, 48), (3, 0)))
    _check(case, oracle_kw={"causal": False}, num_kv_splits=2, block_k=16)


def test_cascade_composition_matches_plain_attention():
    # Three sequences share their first 2 pages (32 tokens); queries start past the prefix.
    case = _case([(1, 45), (4, 40), (1, 33)], pages_per_seq=4)
    table = np.asarray(case.page_indices).copy()
    table[1:3, :2] = table[0, :2]  # the same physical prefix pages for all three
    case = case.replace(page_indices=jnp.asarray(table))
    kernel = functools.partial(ragged_paged_attention, interpret=harness.INTERPRET_GPU)
    out, lse = reference.cascade_attention(*case.args(), 2, sm_scale=SM_SCALE, attention_fn=kernel)
    expected = harness.dense_oracle(case, sm_scale=SM_SCALE)
    harness.assert_close_to_oracle(case, out, lse, expected)


def test_a_nan_key_in_the_shared_prefix_is_nan_in_flat_and_cascade_attention():
    case = _case([(1, 45), (4, 40), (1, 33)], pages_per_seq=4)
    table = np.asarray(case.page_indices).copy()
    table[1:3, :2] = table[0, :2]
    case = harness.nan_in_key(case.replace(page_indices=jnp.asarray(table)), seq=0, key=3)
    kernel = functools.partial(ragged_paged_attention, interpret=harness.INTERPRET_GPU)
    rows, heads = slice(0, case.num_valid_tokens), slice(0, 4)  # q heads of kv head 0
    for num_kv_splits in (1, 2):  # one split; and the merge of splits
        harness.assert_nan_where_the_key_is_seen(
            *_run(case, num_kv_splits=num_kv_splits), rows, heads
        )
    out, lse = reference.cascade_attention(*case.args(), 2, sm_scale=SM_SCALE, attention_fn=kernel)
    harness.assert_nan_where_the_key_is_seen(out, lse, rows, heads)
    assert np.isfinite(np.asarray(lse)[rows, 4:]).all()  # kv head 1 never sees it


def test_soft_cap():
    _check(_case([(1, 37), (6, 20)]), oracle_kw={"soft_cap": 2.0})


def test_sliding_window_page_size_24():
    # Window 8 < block_k 16: blocks wholly outside the window are skipped, edges masked.
    # Pages of 24 tokens: key blocks and pages do not align. Decodes at kv_len 23 and 24
    # put the window's first key (position - 7) on the last key of a key block and on
    # the first of the next: an off-by-one in the block range shows.
    case = _case([(1, 50), (9, 30), (1, 23), (1, 24)], page_size=24)
    _check(case, oracle_kw={"sliding_window": 8}, block_k=16)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_kv_with_scales(kv_dtype):
    case = _case([(1, 37), (4, 20)], dtype=jnp.bfloat16, kv_dtype=kv_dtype)
    # int8 values span +-127, float8 ones about +-3: scales keep the logits O(1). The int8
    # case also caps the logits, whose scale must then include k_scale before the cap.
    int8 = jnp.dtype(kv_dtype) == jnp.dtype(jnp.int8)
    scales = {"k_scale": 0.02, "v_scale": 0.03} if int8 else {"k_scale": 0.5, "v_scale": 0.25}
    if int8:
        scales["soft_cap"] = 1.0
    _check(case, oracle_kw=scales)


def test_default_config_fills_the_gpu_and_reads_shared_pages_rarely():
    llama = dict(
        num_kv_heads=8, group=4, head_dim=128, page_size=16, pages_per_seq=520, q_itemsize=2
    )
    # Small decode batch: 8 sequences x 8 KV heads = 64 programs, so split the keys.
    small = default_config(max_num_tokens=8, max_num_seqs=8, max_q_len=1, kv_itemsize=2, **llama)
    assert (small.block_m, small.num_kv_splits) == (16, 8)
    # Large decode batch: enough programs already.
    big = default_config(
        max_num_tokens=128, max_num_seqs=128, max_q_len=None, kv_itemsize=2, **llama
    )
    assert big.num_kv_splits == 1
    # 16 query heads per KV head still fit the 16-row decode block.
    wide = default_config(
        max_num_tokens=8, max_num_seqs=8, max_q_len=1, kv_itemsize=2, **{**llama, "group": 16}
    )
    assert wide.block_m == 16
    # Prefix pass: one sequence of 128 tokens x 4 heads = 512 rows, in 128-row blocks.
    prefix = default_config(
        max_num_tokens=128, max_num_seqs=1, max_q_len=None, kv_itemsize=2, **llama
    )
    assert prefix.block_m == 128 and prefix.num_kv_splits > 1
    # Key tiles stay within 32 KiB (decode) whatever the KV dtype.
    for itemsize in (1, 2, 4):
        cfg = default_config(
            max_num_tokens=8, max_num_seqs=8, max_q_len=1, kv_itemsize=itemsize, **llama
        )
        assert cfg.block_k * 128 * itemsize <= 32 * 1024
    # Query tiles stay within 32 KiB, 16 KiB for float32 queries (exact dots on FMA
    # units): float32 queries of head_dim 256 take 16-row blocks, and 8 warps.
    f32_256 = {**llama, "head_dim": 256, "q_itemsize": 4}
    prefill = default_config(
        max_num_tokens=2048, max_num_seqs=8, max_q_len=None, kv_itemsize=4, **f32_256
    )
    assert (prefill.block_m, prefill.block_k, prefill.num_warps) == (16, 16, 8)
    # int8 pages are widened to the query dtype before the dots: their key tile is sized
    # as a bfloat16 one.
    for kv_itemsize in (1, 2):
        cfg = default_config(
            max_num_tokens=2048, max_num_seqs=8, max_q_len=None, kv_itemsize=kv_itemsize, **llama
        )
        assert (cfg.block_m, cfg.block_k, cfg.num_warps) == (128, 64, 8)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"head_dim": 48}, "head_dim"),
        ({"block_m": 24}, "block_m"),
        ({"block_m": 16, "heads": (32, 1)}, "block_m"),  # fewer rows than one token's
        ({"block_k": 8}, "block_k"),
        ({"num_kv_splits": 0}, "num_kv_splits"),
    ],
)
def test_rejects_unsupported_static_shapes(kw, match):
    head_dim = kw.pop("head_dim", 64)
    case = _case([(1, 5)], head_dim=head_dim, heads=kw.pop("heads", (8, 2)))
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(
            functools.partial(ragged_paged_attention, sm_scale=SM_SCALE, interpret=True, **kw),
            *case.args(),
        )


def test_float8_needs_compute_capability_8_9(monkeypatch):
    module = importlib.import_module("kernels_pallas.gpu.ragged_paged_attention")
    case = _case([(1, 5)], dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)
    f = functools.partial(ragged_paged_attention, sm_scale=SM_SCALE, k_scale=1.0, v_scale=1.0)
    monkeypatch.setattr(module, "_gpu_compute_capability", lambda: 8.6)  # an A10 or RTX 3090
    with pytest.raises(ValueError, match="compute capability"):
        jax.eval_shape(f, *case.args())
    monkeypatch.setattr(module, "_gpu_compute_capability", lambda: 8.9)  # an L4 or RTX 4090
    jax.eval_shape(f, *case.args())


def test_lower_triton_calls_restores_jaxs_lowering_when_tracing_raises():
    from jax._src.pallas.triton import pallas_call_registration as registration

    before = registration.lowering.lower_jaxpr_to_triton_module

    def broken(q):
        raise ZeroDivisionError("traced function failed")

    with pytest.raises(ZeroDivisionError):
        lower_triton_calls(broken, (jax.ShapeDtypeStruct((2,), jnp.float32),))
    assert registration.lowering.lower_jaxpr_to_triton_module is before


def test_lower_triton_calls_refuses_a_triton_call_it_read_no_module_of():
    # A Triton custom call lowered by another path than the one it wraps (here one made
    # by hand) has no module to pair with: named, not paired with another call's module.
    x = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(RuntimeError, match="^1 Triton custom calls but 0 modules$"):
        lower_triton_calls(jax.ffi.ffi_call("__gpu$xla.gpu.triton", x), (x,))


def test_cuda_lowering_target_refuses_a_device_kind_that_is_not_nvidia():
    with pytest.raises(ValueError, match="device_kind='TPU v5e' must be an NVIDIA device kind"):
        with cuda_lowering_target("TPU v5e"):
            pass


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "kw"),
    [
        (jnp.bfloat16, None, {"num_kv_splits": 4}),
        (jnp.bfloat16, jnp.int8, {"k_scale": 0.1, "v_scale": 0.1, "soft_cap": 30.0}),
        (jnp.bfloat16, jnp.float8_e4m3fn, {"k_scale": 0.1, "v_scale": 0.1, "sliding_window": 9}),
        (jnp.float32, None, {"causal": False, "block_m": 64}),
        (jnp.bfloat16, None, {"causal": False, "out_dtype": jnp.float32}),
        (jnp.float16, jnp.bfloat16, {}),  # computes in float32 (float16's range)
        (jnp.bfloat16, jnp.float32, {"num_kv_splits": 2}),  # float32: the cache's dtype
    ],
    ids=[
        "bf16-splits",
        "int8-softcap",
        "fp8-window",
        "f32-noncausal",
        "bf16-f32-out",
        "f16-bf16",
        "bf16-f32cache",
    ],
)
def test_lowers_for_cuda_to_a_verified_triton_call(dtype, kv_dtype, kw):
    case = _case([(1, 37), (5, 20)], dtype=dtype, kv_dtype=kv_dtype, head_dim=128)
    f = functools.partial(ragged_paged_attention, sm_scale=SM_SCALE, **kw)
    text, calls = lower_triton_calls(f, case.args())
    assert "ragged_paged_attention_gpu" in text
    assert [call.verified for call in calls] == [True]
    if compute_dtype(dtype, kv_dtype or dtype) == jnp.float32:
        # The interpreter multiplies in full float32 whatever the kernel asks; on the GPU a
        # tf32 dot (10-bit mantissa), or one of narrower operands, would break the float32
        # tolerance of 1e-5.
        dots = [line for line in calls[0].ir.splitlines() if "tt.dot" in line]
        assert dots and not any("tf32" in d or "16>" in d for d in dots), dots


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float32])
def test_float16_queries_over_a_wider_cache_match_the_reference(kv_dtype):
    # The kernel cast K and V to the queries' float16: a key of 70000 (or a float16
    # model's 65504, which a bfloat16 cache rounds to 65536) was inf, the row NaN, where
    # the reference, in float32, is finite. The engine builds this pair (a float16
    # model with cache.kv_dtype bfloat16 or float32).
    page_size, head_dim = 16, 16
    kv = np.zeros((3, page_size, 2, head_dim), np.float32)  # 1 KV head: keys, values
    kv[1, :, 0] = 1.0
    kv[1, 0, 0] = 70000.0
    kv[1, :, 1] = np.arange(page_size, dtype=np.float32)[:, None]
    kv[1, 3, 1] = 65536.0
    q = np.full((1, 2, head_dim), 1e-3, np.float16)
    args = [jnp.asarray(q), jnp.asarray(kv).astype(kv_dtype)]
    args += [jnp.asarray(a, jnp.int32) for a in ([8], [[1]], [0, 1], [1])]  # 8 keys
    kw = dict(sm_scale=SM_SCALE, out_dtype=jnp.float32)
    out, lse = ragged_paged_attention(*args, **kw, interpret=harness.INTERPRET_GPU)
    ref_out, ref_lse = reference.ragged_paged_attention(*args, **kw)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-3)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5)
