"""DeviceKVCopier: asynchronous block copies between the paged KV caches and host memory.

The device half of jaxkv.kv_transfer's KVCopier. Copies are dispatched as small jitted
gathers and scatters (block counts padded to powers of two, padding pointing at the null
block 0), so they run in device order with the engine's steps: a save reads the blocks as
the last step left them, a load's scatter precedes every later step. A worker thread
waits for each transfer so the step loop never does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.buckets import padded_size, pow2_buckets

Caches = list[jax.Array]  # num_layers x [num_blocks, block_size, 2*num_kv_heads, head_dim]


@jax.jit
def _gather(
    caches: tuple[jax.Array, ...],
    block_ids: jax.Array,  # i32[n]
) -> jax.Array:  # [n, num_layers, block_size, 2*num_kv_heads, head_dim]
    return jnp.stack([c[block_ids] for c in caches], axis=1)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(
    caches: tuple[jax.Array, ...],
    block_ids: jax.Array,  # i32[n]
    blocks: jax.Array,  # [n, num_layers, block_size, 2*num_kv_heads, head_dim]
) -> tuple[jax.Array, ...]:
    return tuple(c.at[block_ids].set(blocks[:, i]) for i, c in enumerate(caches))


class DeviceKVCopier:
    """Copies whole blocks of every layer; the engine's caches are read and replaced via
    `get_caches` / `set_caches` (a load updates them in place through donation)."""

    def __init__(
        self,
        get_caches: Callable[[], Caches],
        set_caches: Callable[[Caches], None],
        *,
        max_blocks: int,
    ) -> None:
        caches = get_caches()
        layer = caches[0]
        self.bytes_per_block = len(caches) * int(np.prod(layer.shape[1:])) * layer.dtype.itemsize
        self.block_shape = (len(caches), *layer.shape[1:])
        self.dtype = layer.dtype
        self._get_caches = get_caches
        self._set_caches = set_caches
        self._buckets = pow2_buckets(1, max(max_blocks, 1))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxkv-kv-copy")

    def _padded_ids(self, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.zeros(padded_size(self._buckets, len(block_ids), name="len(block_ids)"), np.int32)
        ids[: len(block_ids)] = block_ids
        return ids

    def start_save(self, block_ids: Sequence[int]) -> Future:
        n = len(block_ids)
        gathered = _gather(tuple(self._get_caches()), self._padded_ids(block_ids))
        gathered.copy_to_host_async()
        return self._executor.submit(lambda: np.asarray(gathered)[:n])

    def start_load(self, block_ids: Sequence[int], blocks: np.ndarray) -> Future:
        n = len(block_ids)
        if blocks.shape != (n, *self.block_shape):
            raise ValueError(f"{blocks.shape=} must be {(n, *self.block_shape)}")
        ids = self._padded_ids(block_ids)
        data = np.zeros((len(ids), *self.block_shape), self.dtype)
        data[:n] = blocks
        on_device = jax.device_put(data)
        self._set_caches(list(_scatter(tuple(self._get_caches()), ids, on_device)))
        return self._executor.submit(on_device.block_until_ready)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
