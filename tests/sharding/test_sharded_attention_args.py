"""Sharded paged attention and KV writes (sharded_paged_attention, sharded_write_kv,
TensorParallel's methods): their arguments checked and their results compared with the
unsharded functions', on whatever devices this process has (one CPU is enough)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import sharding
from jaxkv.attention import paged_attention, write_kv
from tests.attention.test_attention_argument_checks import H_KV, H_Q, D, _metadata


def test_an_axis_name_that_is_not_an_axis_of_the_mesh_is_refused_by_name():
    # Traced only: each raises before anything is compiled (a KeyError from mesh.shape before).
    mesh = sharding.make_mesh(1)
    q, kv = jnp.zeros((4, 2, 8)), jnp.zeros((5, 4, 2, 8))
    k = jnp.zeros((4, 1, 8))
    slots = jnp.zeros(4, jnp.int32)
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis of"):
        sharding.sharded_paged_attention(q, kv, None, mesh=mesh, axis_name="tp", sm_scale=1.0)
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis of"):
        sharding.sharded_write_kv(kv, k, k, slots, mesh=mesh, axis_name="tp")
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis of"):
        sharding.plan_tensor_parallel(2, 1, mesh, axis_name="tp")


def test_kv_pages_and_k_v_of_the_wrong_rank_or_no_heads_are_refused_by_name():
    mesh = sharding.make_mesh(1)
    slots = jnp.zeros(4, jnp.int32)
    no_heads = jnp.zeros((5, 4, 0, 8))  # num_kv_heads 0: a ZeroDivisionError on q heads before
    with pytest.raises(ValueError, match=r"kv_pages.shape=\(5, 4, 0, 8\) must be"):
        sharding.sharded_paged_attention(
            jnp.zeros((4, 2, 8)), no_heads, None, mesh=mesh, sm_scale=1.0
        )
    kv, flat = jnp.zeros((5, 4, 16, 8)), jnp.zeros((4, 8))  # k without its head_dim axis
    with pytest.raises(
        ValueError, match=r"k.shape=\(4, 8\) must be \[max_num_tokens, 8, head_dim\]"
    ):
        sharding.sharded_write_kv(kv, flat, jnp.zeros((4, 8, 8)), slots, mesh=mesh)


def test_tensor_parallel_attention_takes_a_scale_given_as_a_jax_scalar():
    # TensorParallel's methods have the signatures of jaxkv.attention's, which take
    # 1 / jnp.sqrt(head_dim); they failed with jax's "Non-hashable static arguments".
    md, tp = _metadata(), sharding.TensorParallel(sharding.make_mesh(1))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(md.max_num_tokens, H_Q, D)), jnp.float32)
    pages = jnp.asarray(rng.normal(size=(64, 4, 2 * H_KV, D)), jnp.float32)
    want = paged_attention(q, pages, md, sm_scale=0.125)
    got = tp.paged_attention(q, pages, md, sm_scale=1 / jnp.sqrt(jnp.float32(D)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    got = sharding.sharded_paged_attention(q, pages, md, mesh=tp.mesh, sm_scale=np.array(0.125))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    k = jnp.ones((md.max_num_tokens, H_KV, D), jnp.float32)
    int8_pages = jnp.zeros((64, 4, 2 * H_KV, D), jnp.int8)
    written = tp.write_kv(int8_pages, k, k, md.slot_mapping, k_scale=jnp.float32(0.5))
    assert int(np.asarray(written).max()) == 2  # 1 / 0.5


def test_replicated_kv_heads_are_written_once_per_device_that_holds_them():
    # kv_replicas=2: each KV head sits on the two devices whose query heads read it, so
    # write_kv repeats every head twice, in place (head h at 2h and 2h + 1); here on one
    # device, where the 8-device mesh checks would otherwise be the only ones to see it.
    md, tp = _metadata(), sharding.TensorParallel(sharding.make_mesh(1), kv_replicas=2)
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.normal(size=(md.max_num_tokens, H_KV, D)), jnp.float32) for _ in "kv")
    shape = (64, 4, 4 * H_KV, D)  # each write donates its cache: one each
    got = tp.write_kv(jnp.zeros(shape), k, v, md.slot_mapping)
    k2, v2 = jnp.repeat(k, 2, axis=1), jnp.repeat(v, 2, axis=1)
    want = write_kv(jnp.zeros(shape), k2, v2, md.slot_mapping)
    assert np.asarray(want).any()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_query_heads_that_are_no_multiple_of_the_kv_heads_are_refused_by_name():
    """3 query heads over 2 KV heads are no grouped-query model: named with both counts
    on the whole arrays, before any shard is cut."""
    mesh = sharding.make_mesh(1)
    with pytest.raises(ValueError, match=r"^num_q_heads=3 must be a multiple of num_kv_heads=2"):
        sharding.sharded_paged_attention(
            jnp.zeros((4, 3, 8)), jnp.zeros((5, 4, 4, 8)), None, mesh=mesh, sm_scale=1.0
        )


def test_kv_pages_of_rank_three_are_refused_by_name():
    """A cache without its head_dim axis is named as kv_pages, not failed in shard_map."""
    mesh = sharding.make_mesh(1)
    with pytest.raises(ValueError, match=r"kv_pages.shape=\(5, 4, 2\) must be"):
        sharding.sharded_paged_attention(
            jnp.zeros((4, 2, 8)), jnp.zeros((5, 4, 2)), None, mesh=mesh, sm_scale=1.0
        )


def test_sharded_attention_and_write_take_a_mesh_of_explicit_axes():
    """shard_map refused their head specs on jax.make_mesh's Explicit axes ("in_specs ...
    does not match the specs of the input"); they run on the mesh's Auto twin."""
    from jax.sharding import AxisType

    md = _metadata()
    mesh = jax.make_mesh((1,), (sharding.DEFAULT_AXIS,), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(md.max_num_tokens, H_Q, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(md.max_num_tokens, H_KV, D)), jnp.float32)
    shape = (64, 4, 2 * H_KV, D)  # each write donates its cache: one each
    want_kv = write_kv(jnp.zeros(shape), k, k, md.slot_mapping)
    got_kv = sharding.sharded_write_kv(jnp.zeros(shape), k, k, md.slot_mapping, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(got_kv), np.asarray(want_kv))
    want = paged_attention(q, want_kv, md, sm_scale=0.125)
    got = sharding.sharded_paged_attention(q, want_kv, md, mesh=mesh, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_sharded_write_kv_writes_nothing_for_a_64_bit_slot_past_int32():
    # shard_map converted numpy int64 slots to int32 by wrapping, before write_kv could
    # drop them: 2**32 + 6 became slot 6 and overwrote a live block's KV.
    mesh = sharding.make_mesh(1)
    kv = jnp.zeros((6, 4, 2 * H_KV, D))
    k = jnp.ones((4, H_KV, D))
    slots = np.array([9, 2**32 + 6, 2**33 + 13, 2**31], np.int64)
    out = np.asarray(sharding.sharded_write_kv(kv, k, k, slots, mesh=mesh))
    assert np.argwhere(np.any(out != 0, axis=(2, 3))).tolist() == [[2, 1]]


def test_sharded_paged_attention_checks_hand_made_metadata_as_paged_attention_does():
    """Its jit and shard_map hid the values from the kernels' checks: a page id past the
    cache read a clamped page, and a float64 numpy q was converted silently."""
    mesh, md = sharding.make_mesh(1), _metadata()
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages = jnp.zeros((64, 4, 2 * H_KV, D), jnp.float32)
    assert sharding.sharded_paged_attention(q, pages, md, mesh=mesh, sm_scale=0.125).shape
    level = dataclasses.replace(
        md.levels[0], page_indices=np.full_like(md.levels[0].page_indices, 64)
    )
    with pytest.raises(ValueError, match=r"^metadata\.levels\[0\]: page_indices\[0, 0\]=64"):
        sharding.sharded_paged_attention(
            q, pages, dataclasses.replace(md, levels=(level,)), mesh=mesh, sm_scale=0.125
        )
    with pytest.raises(ValueError, match=r"q\.dtype=float64"):
        sharding.sharded_paged_attention(np.zeros(q.shape), pages, md, mesh=mesh, sm_scale=0.125)
