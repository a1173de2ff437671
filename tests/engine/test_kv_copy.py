"""DeviceKVCopier on small caches: a save returns exactly the blocks asked for, a load
writes exactly those blocks of every layer and nothing else but the null block."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import kv_copy
from jaxkv.kv_copy import DeviceKVCopier

NUM_LAYERS, NUM_BLOCKS = 2, 8
BLOCK_SHAPE = (2, 2, 4)  # block_size, 2 * num_kv_heads, head_dim


def test_save_and_load_move_exactly_the_listed_blocks_of_every_layer():
    rng = np.random.default_rng(0)
    host = rng.standard_normal((NUM_LAYERS, NUM_BLOCKS, *BLOCK_SHAPE)).astype(np.float32)
    state = {"caches": [jnp.asarray(c) for c in host]}
    copier = DeviceKVCopier(
        lambda: state["caches"], lambda c: state.update(caches=c), max_blocks=NUM_BLOCKS
    )
    try:
        # Three blocks (padded to a bucket of four), out of order: block i of layer l.
        saved = copier.start_save([5, 1, 3]).result()
        np.testing.assert_array_equal(saved, np.moveaxis(host[:, [5, 1, 3]], 0, 1))

        new = rng.standard_normal((3, NUM_LAYERS, *BLOCK_SHAPE)).astype(np.float32)
        with pytest.raises(ValueError, match=r"blocks.shape"):
            copier.start_load([2, 6], new)  # three blocks for two ids: refused, nothing written
        # The null block, one past the cache, a float: refused, nothing written.
        for bad in ([0, 6, 7], [2, 6, NUM_BLOCKS], [2.0, 6, 7], [-1, 6, 7]):
            with pytest.raises(ValueError, match=r"block_ids=.* must be block ids in \[1, 8\)"):
                copier.start_load(bad, new)
        with pytest.raises(ValueError, match=r"block_ids=\[9\] must be block ids"):
            copier.start_save([9])
        for got, exp in zip(state["caches"], host, strict=True):
            np.testing.assert_array_equal(np.asarray(got), exp)
        copier.start_load([2, 6, 7], new).result()
        expected = host.copy()
        expected[:, [2, 6, 7]] = np.moveaxis(new, 1, 0)
        # Block 0 is the null block the padding writes into; every other block is exact.
        for got, exp in zip(state["caches"], expected, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[1:], exp[1:])
    finally:
        copier.close()


def _replicated(blocks: np.ndarray, kv_replicas: int) -> np.ndarray:
    """[..., 2*H, D] (K, V of each head interleaved) -> [..., 2*H*r, D] with each head's
    (K, V) pair repeated r times in place, as jaxkv.sharding writes the cache."""
    *lead, combined, dim = blocks.shape
    pairs = blocks.reshape(*lead, combined // 2, 2, dim)
    return np.repeat(pairs, kv_replicas, axis=len(lead)).reshape(*lead, combined * kv_replicas, dim)


@pytest.mark.parametrize("kv_replicas", [2, np.int64(4)])  # numpy integers count too
def test_replicated_kv_heads_are_stored_once_and_loaded_into_every_replica(kv_replicas):
    rng = np.random.default_rng(1)
    logical = rng.standard_normal((NUM_LAYERS, NUM_BLOCKS, 2, 4, 4)).astype(np.float32)
    state = {"caches": [jnp.asarray(_replicated(c, kv_replicas)) for c in logical]}
    copier = DeviceKVCopier(
        lambda: state["caches"],
        lambda c: state.update(caches=c),
        max_blocks=NUM_BLOCKS,
        kv_replicas=kv_replicas,
    )
    try:
        assert copier.block_shape == (NUM_LAYERS, 2, 4, 4) and type(copier.kv_replicas) is int
        assert copier.bytes_per_block == NUM_LAYERS * 2 * 4 * 4 * 4
        saved = copier.start_save([6, 2]).result()
        np.testing.assert_array_equal(saved, np.moveaxis(logical[:, [6, 2]], 0, 1))

        new = rng.standard_normal((2, NUM_LAYERS, 2, 4, 4)).astype(np.float32)
        copier.start_load([3, 5], new).result()
        expected = logical.copy()
        expected[:, [3, 5]] = np.moveaxis(new, 1, 0)
        for got, exp in zip(state["caches"], expected, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[1:], _replicated(exp, kv_replicas)[1:])
    finally:
        copier.close()


@pytest.mark.parametrize("kv_replicas, heads", [(1, "tp"), (2, None)])
def test_a_load_into_caches_on_a_mesh_is_staged_on_that_mesh(kv_replicas, heads):
    # Split along heads as the caches are when they hold each KV head once; whole on
    # each device when they hold replicas (a host block holds each head once).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    cache = NamedSharding(mesh, P(None, None, "tp"))  # shorter than the caches' rank
    staged = kv_copy.staging_sharding(cache, kv_replicas)
    assert isinstance(staged, NamedSharding) and staged.mesh == mesh
    assert tuple(staged.spec) == (None, None, None, heads)


# 4: divides the 4 combined (K, V) positions but not the 2 KV heads.
@pytest.mark.parametrize("kv_replicas", [0, 3, 4, 2.0, True, np.bool_(True)])
def test_a_replica_count_that_does_not_divide_the_cache_heads_is_refused(kv_replicas):
    caches = [jnp.zeros((NUM_BLOCKS, 2, 4, 4))]  # 2 KV heads
    with pytest.raises(ValueError, match="kv_replicas="):
        DeviceKVCopier(lambda: caches, lambda c: None, max_blocks=4, kv_replicas=kv_replicas)


class _Weights:
    """Stands for a model's parameters: collected once nothing refers to them."""


def test_the_fingerprint_is_computed_once_and_its_weights_let_go():
    state = {"caches": [jnp.zeros((4, 2, 2, 4), jnp.float32)]}
    weights = _Weights()
    alive = weakref.ref(weights)
    calls = []

    def fingerprint(held=weights) -> bytes:
        calls.append(held)
        return b"fp"

    copier = DeviceKVCopier(
        lambda: state["caches"],
        lambda c: state.update(caches=c),
        max_blocks=4,
        fingerprint=fingerprint,
    )
    del weights, fingerprint
    try:
        assert copier.model_fingerprint == b"fp" and copier.model_fingerprint == b"fp"
        assert len(calls) == 1
        calls.clear()
        gc.collect()
        assert alive() is None  # the copier, still open, no longer holds the weights
    finally:
        copier.close()


def test_without_a_fingerprint_the_model_fingerprint_is_none():
    state = {"caches": [jnp.zeros((4, 2, 2, 4), jnp.float32)]}
    copier = DeviceKVCopier(lambda: state["caches"], lambda c: None, max_blocks=4)
    try:
        assert copier.model_fingerprint is None
    finally:
        copier.close()


def test_closing_a_copier_lets_go_of_the_weights_of_a_fingerprint_never_read():
    state = {"caches": [jnp.zeros((4, 2, 2, 4), jnp.float32)]}
    weights = _Weights()
    alive = weakref.ref(weights)
    copier = DeviceKVCopier(
        lambda: state["caches"],
        lambda c: None,
        max_blocks=4,
        fingerprint=lambda held=weights: b"fp",
    )
    del weights
    copier.close()
    gc.collect()
    assert alive() is None


def test_a_copy_may_hold_max_blocks_blocks_or_none_but_no_more():
    rng = np.random.default_rng(2)
    host = rng.standard_normal((NUM_LAYERS, NUM_BLOCKS, *BLOCK_SHAPE)).astype(np.float32)
    state = {"caches": [jnp.asarray(c) for c in host]}
    # Buckets 1, 2, 4, then max_blocks itself.
    copier = DeviceKVCopier(lambda: state["caches"], lambda c: state.update(caches=c), max_blocks=5)
    try:
        ids = [7, 1, 2, 6, 3]
        saved = copier.start_save(ids).result()
        np.testing.assert_array_equal(saved, np.moveaxis(host[:, ids], 0, 1))
        with pytest.raises(ValueError, match=r"len\(block_ids\)=6 exceeds"):
            copier.start_save([1, 2, 3, 4, 5, 6])
        assert copier.start_save([]).result().shape == (0, NUM_LAYERS, *BLOCK_SHAPE)
        copier.start_load([], np.zeros((0, NUM_LAYERS, *BLOCK_SHAPE), np.float32)).result()
        for got, exp in zip(state["caches"], host, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[1:], exp[1:])
    finally:
        copier.close()


def test_a_copier_of_bfloat16_caches_declares_and_saves_bfloat16_blocks():
    caches = [jnp.ones((NUM_BLOCKS, *BLOCK_SHAPE), jnp.bfloat16)] * NUM_LAYERS
    copier = DeviceKVCopier(lambda: caches, lambda c: None, max_blocks=4)
    try:
        saved = copier.start_save([3]).result()
        assert copier.dtype == saved.dtype == jnp.bfloat16
        assert copier.bytes_per_block == NUM_LAYERS * int(np.prod(BLOCK_SHAPE)) * 2
    finally:
        copier.close()


def test_a_load_of_blocks_of_another_block_shape_is_refused_even_when_they_would_broadcast():
    caches = [jnp.zeros((NUM_BLOCKS, *BLOCK_SHAPE), jnp.float32)] * NUM_LAYERS
    copier = DeviceKVCopier(lambda: caches, lambda c: None, max_blocks=4)
    try:
        one_layer = np.ones((2, 1, *BLOCK_SHAPE), np.float32)  # [2, 1 layer, ...]
        with pytest.raises(ValueError, match=r"blocks.shape=\(2, 1, 2, 2, 4\) must be"):
            copier.start_load([2, 3], one_layer)
    finally:
        copier.close()


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.float16])
def test_a_load_of_blocks_of_another_dtype_is_refused_not_cast(dtype):
    # They were cast into the cache, the KV changed silently (1e300 as float64 became
    # inf): the connector's stored blocks always have the copier's dtype, anything else
    # is a caller's mistake.
    host = np.zeros((NUM_LAYERS, NUM_BLOCKS, *BLOCK_SHAPE), np.float32)
    state = {"caches": [jnp.asarray(c) for c in host]}
    copier = DeviceKVCopier(lambda: state["caches"], lambda c: state.update(caches=c), max_blocks=4)
    try:
        blocks = np.ones((2, NUM_LAYERS, *BLOCK_SHAPE), dtype)
        with pytest.raises(ValueError, match=r"blocks.dtype=.* must be the caches' float32"):
            copier.start_load([2, 3], blocks)
        for got in state["caches"]:
            np.testing.assert_array_equal(np.asarray(got), 0)
        copier.start_load([2, 3], blocks.astype(np.float32)).result()
        assert np.asarray(state["caches"][0])[2:4].min() == 1
    finally:
        copier.close()


def test_a_load_into_a_block_given_twice_is_refused():
    # A scatter with a repeated index keeps whichever of its blocks the device picks.
    host = np.zeros((NUM_LAYERS, NUM_BLOCKS, *BLOCK_SHAPE), np.float32)
    state = {"caches": [jnp.asarray(c) for c in host]}
    copier = DeviceKVCopier(lambda: state["caches"], lambda c: state.update(caches=c), max_blocks=4)
    try:
        blocks = np.stack([np.full((NUM_LAYERS, *BLOCK_SHAPE), v, np.float32) for v in (1, 2)])
        with pytest.raises(ValueError, match=r"block_ids=\[2, 2\] must each be given once"):
            copier.start_load([2, 2], blocks)
        for got in state["caches"]:
            np.testing.assert_array_equal(np.asarray(got), 0)
        np.testing.assert_array_equal(copier.start_save([2, 2]).result()[1], 0)  # harmless
    finally:
        copier.close()


@pytest.mark.parametrize("block_ids", [3, iter([1, 2]), None], ids=["int", "iterator", "None"])
def test_block_ids_that_are_no_sequence_are_refused_by_name(block_ids):
    # len(block_ids) ran first and raised TypeError ("object of type 'int' has no len()").
    caches = [jnp.zeros((NUM_BLOCKS, *BLOCK_SHAPE), jnp.float32)] * NUM_LAYERS
    copier = DeviceKVCopier(lambda: caches, lambda c: None, max_blocks=4)
    try:
        with pytest.raises(ValueError, match=r"block_ids=.* must be block ids in \[1, 8\)"):
            copier.start_save(block_ids)
        with pytest.raises(ValueError, match=r"block_ids=.* must be block ids in \[1, 8\)"):
            copier.start_load(block_ids, np.zeros((1, NUM_LAYERS, *BLOCK_SHAPE), np.float32))
        with pytest.raises(ValueError, match=r"blocks.shape=None must be \(1, 2, 2, 2, 4\)"):
            copier.start_load([1], [[0.0]])  # no array: AttributeError on .shape before
    finally:
        copier.close()


@pytest.mark.parametrize("max_blocks", [0, -2, 2.5, None, True])
def test_a_max_blocks_that_is_not_a_positive_int_is_refused(max_blocks):
    # 0 once became a copier of one-block copies, past the bound it was given.
    caches = [jnp.zeros((NUM_BLOCKS, *BLOCK_SHAPE), jnp.float32)] * NUM_LAYERS
    with pytest.raises(ValueError, match=r"max_blocks=.* must be an int >= 1"):
        DeviceKVCopier(lambda: caches, lambda c: None, max_blocks=max_blocks)


def test_max_blocks_may_be_a_numpy_integer():
    caches = [jnp.zeros((NUM_BLOCKS, *BLOCK_SHAPE), jnp.float32)] * NUM_LAYERS
    copier = DeviceKVCopier(lambda: caches, lambda c: None, max_blocks=np.int64(1))
    try:
        assert copier.start_save([3]).result().shape == (1, NUM_LAYERS, *BLOCK_SHAPE)
        with pytest.raises(ValueError, match=r"len\(block_ids\)=2 exceeds"):
            copier.start_save([3, 4])
    finally:
        copier.close()


class _GuardSeen:
    """Stands in for a gathered save: records the device-to-host guard in force on the
    thread that reads it (the CPU backend never enforces one, so a real read passes)."""

    def __init__(self, blocks: np.ndarray) -> None:
        self.blocks, self.guard = blocks, None

    def copy_to_host_async(self) -> None:
        pass

    def __array__(self, dtype=None, copy=None):
        self.guard = jax.config.jax_transfer_guard_device_to_host
        return self.blocks


def test_a_save_is_read_on_the_host_under_allow_whatever_guard_is_set_globally(monkeypatch):
    # The worker thread read the saved blocks with np.asarray outside allowing_transfers:
    # a caller's `with jax.transfer_guard` stays on its own thread, but a global guard
    # reaches the worker, and on an accelerator refuses that implicit read.
    blocks = np.arange(2 * NUM_LAYERS * np.prod(BLOCK_SHAPE), dtype=np.float32)
    seen = _GuardSeen(blocks.reshape(2, NUM_LAYERS, *BLOCK_SHAPE))
    monkeypatch.setattr(kv_copy, "_gather", lambda *args: seen)
    caches = [jnp.zeros((NUM_BLOCKS, *BLOCK_SHAPE), jnp.float32)] * NUM_LAYERS
    copier = DeviceKVCopier(lambda: caches, lambda c: None, max_blocks=NUM_BLOCKS)
    jax.config.update("jax_transfer_guard_device_to_host", "disallow")
    try:
        saved = copier.start_save([3, 4]).result()
    finally:
        jax.config.update("jax_transfer_guard_device_to_host", None)
        copier.close()
    assert seen.guard == "allow"
    np.testing.assert_array_equal(saved, seen.blocks)


def test_a_closed_copier_starts_no_copy_and_touches_no_cache():
    # It used to run the gather (a save) or replace the caches (a load) before the closed
    # executor refused the future: device work and, for a load, donated caches for nothing.
    host = np.arange(NUM_LAYERS * NUM_BLOCKS * np.prod(BLOCK_SHAPE), dtype=np.float32)
    state = {"caches": list(jnp.asarray(host.reshape(NUM_LAYERS, NUM_BLOCKS, *BLOCK_SHAPE)))}
    reads = []

    def get_caches():
        reads.append(1)
        return state["caches"]

    copier = DeviceKVCopier(get_caches, lambda c: state.update(caches=c), max_blocks=NUM_BLOCKS)
    copier.close()
    reads.clear()  # the constructor reads the caches' layout
    before = list(state["caches"])
    blocks = np.zeros((1, NUM_LAYERS, *BLOCK_SHAPE), np.float32)
    for start in (lambda: copier.start_save([1]), lambda: copier.start_load([1], blocks)):
        with pytest.raises(RuntimeError, match="closed"):
            start()
    assert not reads and all(a is b for a, b in zip(state["caches"], before, strict=True))
    assert not any(c.is_deleted() for c in state["caches"])


def test_each_of_three_kv_heads_replicated_twice_in_a_one_layer_cache_loads_into_its_own():
    # With two heads, reading another replica of a head's neighbour read the same KV; and
    # a model of one layer has one cache, where the others' caches[1] does not exist.
    assert [list(a) for a in kv_copy.replica_heads(12, 2)] == [
        [0, 1, 4, 5, 8, 9],
        [0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5],
    ]
    logical = np.arange(NUM_BLOCKS * 2 * 6 * 4, dtype=np.float32).reshape(NUM_BLOCKS, 2, 6, 4)
    state = {"caches": [jnp.asarray(_replicated(logical, 2))]}
    copier = DeviceKVCopier(
        lambda: state["caches"], lambda c: state.update(caches=c), max_blocks=2, kv_replicas=2
    )
    try:
        saved = copier.start_save([4]).result()
        np.testing.assert_array_equal(saved, logical[[4], None])
        copier.start_load([3], -saved).result()
        expected = logical.copy()
        expected[3] = -logical[4]
        np.testing.assert_array_equal(
            np.asarray(state["caches"][0])[1:], _replicated(expected, 2)[1:]
        )
    finally:
        copier.close()


def test_a_refused_replica_count_names_the_cache_s_kv_heads():
    caches = [jnp.zeros((NUM_BLOCKS, 2, 12, 4))]  # 6 KV heads
    with pytest.raises(
        ValueError, match=r"kv_replicas=4 must be .* divides the cache's 6 KV heads"
    ):
        DeviceKVCopier(lambda: caches, lambda c: None, max_blocks=4, kv_replicas=4)
