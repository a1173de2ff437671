"""DeviceKVCopier: asynchronous block copies between the paged KV caches and host memory.

The device half of jaxkv.kv_transfer's KVCopier. Copies are dispatched as small jitted
gathers and scatters (block counts padded to a power of two below max_blocks, or to
max_blocks itself; padding pointing at the null block 0), so they run in device order
with the engine's steps: a save reads the blocks as the last step left them, a load's
scatter precedes every later step. A worker thread waits for each transfer so the step
loop never does: a save's Future is done once its blocks are in host memory, a load's
once its scatter has run, its blocks in the caches.

Host blocks hold each KV head once. Under tensor parallelism wider than the KV heads
(jaxkv.sharding), the cache holds every KV head `kv_replicas` times; a save keeps the
first replica of each head and a load writes every replica, so the host store's layout
does not depend on the tensor-parallel width and holds no copy twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.buckets import padded_size, pow2_buckets
from jaxkv.deliberate_transfers import allowing_transfers
from jaxkv.field_checks import as_int
from jaxkv.held_interrupts import holding_interrupts

Caches = list[jax.Array]  # num_layers x [num_blocks, block_size, 2*num_kv_heads, head_dim]


def replica_heads(num_cache_heads: int, kv_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, expand) for a cache axis of `num_cache_heads` combined heads that holds each
    KV head `kv_replicas` times, K of combined head c at 2c and V at 2c+1, replicas of a
    head adjacent (jaxkv.sharding's layout): `first` lists the cache positions of each
    head's first replica, K and V interleaved as the cache does; `expand[p]` is the index
    into `first` that cache position p repeats."""
    p = np.arange(num_cache_heads)
    expand = 2 * (p // 2 // kv_replicas) + p % 2
    j = np.arange(num_cache_heads // kv_replicas)
    first = 2 * (j // 2) * kv_replicas + j % 2
    return first, expand


def staging_sharding(cache_sharding: jax.sharding.Sharding, kv_replicas: int):
    """Where a load's blocks ([n, num_layers, block_size, 2*num_kv_heads, head_dim], each
    KV head once) go before the scatter writes them into caches of `cache_sharding`: on
    the caches' own devices, split along heads as the caches are when they hold each head
    once, else whole on each. Put without a sharding they went to jax's default device,
    which under data parallelism belongs to another replica (its memory, not this one's,
    held each copy while it ran)."""
    if isinstance(cache_sharding, NamedSharding):
        spec = (*cache_sharding.spec, None, None, None)
        heads = spec[2] if kv_replicas == 1 else None
        return NamedSharding(cache_sharding.mesh, P(None, None, None, heads))
    devices = sorted(cache_sharding.device_set, key=lambda d: d.id)
    if len(devices) == 1:
        return jax.sharding.SingleDeviceSharding(devices[0])
    return NamedSharding(jax.sharding.Mesh(np.array(devices), ("devices",)), P())


def _read_on_host(gathered: jax.Array, n: int) -> np.ndarray:
    """The first `n` saved blocks as numpy, read on the copier's worker thread. The
    caller's `with jax.transfer_guard(...)` does not reach this thread, but a global
    guard (jax_transfer_guard set in the config or the environment) does, and would
    refuse this implicit device-to-host read on an accelerator and fail every save."""
    with allowing_transfers():  # deliberate, whatever guard is set globally
        return np.asarray(gathered)[:n]


def _scattered(written: jax.Array, staged: jax.Array) -> jax.Array:
    """`staged`, once `written` (the scatter's scalar) is ready: the scatter has run."""
    written.block_until_ready()
    return staged


@functools.partial(jax.jit, static_argnames="kv_replicas")
def _gather(
    caches: tuple[jax.Array, ...],
    block_ids: jax.Array,  # i32[n]
    kv_replicas: int,
) -> jax.Array:  # [n, num_layers, block_size, 2*num_kv_heads, head_dim]
    blocks = jnp.stack([c[block_ids] for c in caches], axis=1)
    if kv_replicas == 1:
        return blocks
    first, _ = replica_heads(blocks.shape[3], kv_replicas)
    return blocks[:, :, :, first]


@functools.partial(jax.jit, donate_argnums=0, static_argnames="kv_replicas")
def _scatter(
    caches: tuple[jax.Array, ...],
    block_ids: jax.Array,  # i32[n]
    blocks: jax.Array,  # [n, num_layers, block_size, 2*num_kv_heads, head_dim]
    kv_replicas: int,
) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """(the caches with `blocks` written, a scalar the program writes too): the caches are
    donated to the next step, so the copy thread waits on the scalar instead, ready once
    the program has run, or failed with it."""
    if kv_replicas > 1:
        _, expand = replica_heads(caches[0].shape[2], kv_replicas)
        blocks = blocks[:, :, :, expand]
    new = tuple(c.at[block_ids].set(blocks[:, i]) for i, c in enumerate(caches))
    return new, jnp.zeros((), jnp.int32)


class DeviceKVCopier:
    """Copies whole blocks of every layer; the engine's caches are read and replaced via
    `get_caches` / `set_caches` (a load updates them in place through donation).

    One copy holds at most `max_blocks` blocks (an int >= 1; ValueError otherwise).
    `kv_replicas` is how many times the cache holds each KV head (TensorParallel's);
    host blocks (`block_shape`, `bytes_per_block`) hold each head once.
    `model_fingerprint` names the model that computed the KV (jaxkv.model_fingerprint):
    computed by `fingerprint` on first use, None without one.
    """

    def __init__(
        self,
        get_caches: Callable[[], Caches],
        set_caches: Callable[[Caches], None],
        *,
        max_blocks: int,
        kv_replicas: int = 1,
        fingerprint: Callable[[], bytes] | None = None,
    ) -> None:
        max_copy = as_int(max_blocks)
        if max_copy is None or max_copy < 1:
            raise ValueError(f"{max_blocks=} must be an int >= 1: the most blocks one copy holds")
        caches = get_caches()
        layer = caches[0]
        num_cache_heads = layer.shape[2]
        replicas = as_int(kv_replicas)
        if replicas is None or replicas < 1 or num_cache_heads % (2 * replicas):
            raise ValueError(
                f"{kv_replicas=} must be an int >= 1 that divides the cache's "
                f"{num_cache_heads // 2} KV heads"
            )
        kv_replicas = replicas
        self.kv_replicas = kv_replicas
        self.block_shape = (
            len(caches),
            layer.shape[1],
            num_cache_heads // kv_replicas,
            *layer.shape[3:],
        )
        self.bytes_per_block = int(np.prod(self.block_shape)) * layer.dtype.itemsize
        self.dtype = layer.dtype
        self.num_blocks = layer.shape[0]
        self._get_caches = get_caches
        self._set_caches = set_caches
        self._buckets = pow2_buckets(1, max_copy)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxkv-kv-copy")
        self._fingerprint = fingerprint
        self.closed = False  # True once close() was called: no copy starts any more

    @functools.cached_property
    def model_fingerprint(self) -> bytes | None:
        if self._fingerprint is None:
            return None
        value = self._fingerprint()
        self._fingerprint = None  # it holds the weights: let them go once read
        return value

    def _padded_ids(self, block_ids: Sequence[int]) -> np.ndarray:
        """`block_ids` padded with 0 to a bucket; ValueError naming them unless each is a
        block of the cache other than the null block 0 (the scatter would drop one past
        the cache silently, and write into the null block where every pad writes)."""
        given = np.asarray(block_ids)
        if given.ndim != 1 or (
            given.size
            and (given.dtype.kind not in "iu" or given.min() < 1 or given.max() >= self.num_blocks)
        ):
            raise ValueError(f"block_ids={block_ids!r} must be block ids in [1, {self.num_blocks})")
        ids = np.zeros(padded_size(self._buckets, len(given), name="len(block_ids)"), np.int32)
        ids[: len(given)] = given
        return ids

    def start_save(self, block_ids: Sequence[int]) -> Future:
        ids = self._padded_ids(block_ids)  # first: it names block_ids that have no len
        n = len(block_ids)
        self._check_open()
        with allowing_transfers():  # deliberate, whatever guard the caller set
            gathered = _gather(tuple(self._get_caches()), ids, self.kv_replicas)
            gathered.copy_to_host_async()
        return self._executor.submit(_read_on_host, gathered, n)

    def start_load(self, block_ids: Sequence[int], blocks: np.ndarray) -> Future:
        """Writes `blocks` ([len(block_ids), *block_shape], of the caches' dtype) into
        `block_ids`; ValueError, nothing written, on another shape or dtype (a cast would
        change the KV silently: float64 past float32's range became inf) or a block id
        given twice (which of its blocks a scatter keeps is up to the device).

        The caches are replaced at once (later steps read the new ones, after the
        scatter in device order); the Future is done once the scatter has run, so a
        scatter that fails on the device fails the load, its exception the Future's
        (the caches it returned fail the next step as well). Its result is the staged
        blocks on the device, before the scatter."""
        ids = self._padded_ids(block_ids)  # first: it names block_ids that have no len
        n = len(block_ids)
        shape = getattr(blocks, "shape", None)  # None: no array (a list)
        if shape != (n, *self.block_shape):
            raise ValueError(f"blocks.shape={shape} must be {(n, *self.block_shape)}")
        if blocks.dtype != self.dtype:
            raise ValueError(f"blocks.dtype={blocks.dtype} must be the caches' {self.dtype}")
        if len(np.unique(ids[:n])) != n:
            raise ValueError(f"block_ids={block_ids!r} must each be given once")
        self._check_open()
        data = np.zeros((len(ids), *self.block_shape), self.dtype)
        data[:n] = blocks
        with allowing_transfers():  # deliberate, whatever guard the caller set
            donated = tuple(self._get_caches())
            on_device = jax.device_put(
                data, staging_sharding(donated[0].sharding, self.kv_replicas)
            )
            # It donates the caches: a Ctrl-C raised before the new ones are set would
            # leave the engine only deleted ones (jaxkv.held_interrupts).
            with holding_interrupts(passes_on=lambda: not donated[0].is_deleted()):
                caches, written = _scatter(donated, ids, on_device, self.kv_replicas)
                self._set_caches(list(caches))
        return self._executor.submit(_scattered, written, on_device)

    def _check_open(self) -> None:
        """RuntimeError once closed, before any device work: the executor would refuse the
        copy only after the gather ran, or a load had replaced the caches."""
        if self.closed:
            raise RuntimeError("the KV copier is closed: it starts no copy")

    def close(self, *, wait: bool = True) -> None:
        """Stops the copy thread: copies not yet begun are cancelled; with `wait` it
        returns once the one running has ended. Without, a copy that never ends (a hung
        device) cannot hold the caller: the thread ends with that copy, if ever (and the
        interpreter's exit waits for it, as for every executor's thread)."""
        self.closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._fingerprint = None
