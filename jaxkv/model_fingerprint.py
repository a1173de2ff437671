"""A fingerprint of what a model's KV depends on: its config and every weight's bits.

KV saved by one engine is valid for another only if both would compute the same KV for
the same tokens. Block hashes name the tokens; this names the model: a 16-byte BLAKE2b
digest of the config (as JSON, sorted keys), each weight's shape and dtype, and four
32-bit checksums of each weight's bits computed on the device the weight lives on.

Guarantees:
- Equal configs and bitwise-equal weights give equal fingerprints, whatever the weights'
  placement (one device or sharded over a mesh) and whichever objects hold them: each
  checksum is a wrapping uint32 sum, exact in any reduction order.
- Any other config, shape or dtype gives a different one. Different bits give a different
  one unless all four checksums of some weight collide by chance: each sums, over the
  weight's words, murmur3's finalizer of the word mixed with its index under the lane's
  own salt, so a changed, moved or swapped word changes every lane but with a chance of
  about 2**-32 each (about 2**-128 together, taking the lanes as independent). The
  checksums are not a cryptographic digest and do not resist weights crafted to collide.
- Cost: one read of every weight on its device (one jitted program per distinct shape
  and dtype, so a deep model compiles no more than a shallow one) and 16 bytes per weight
  back to the host.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FINGERPRINT_NUM_BYTES = 16
_SALTS = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)  # one per checksum lane
_KINDS = (jnp.bool_, jnp.integer, jnp.floating, jax.dtypes.prng_key)
_UNSIGNED_OF_ITEMSIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _fmix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit affects every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32, in x's shape (8-byte items: a trailing axis of 2 words;
    a PRNG key: its key data; a sub-byte item: its value, widened exactly)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jax.dtypes.itemsize_bits(x.dtype) < 8:  # int4, float4, ...: bitcasts would pack pairs
        x = x.astype(jnp.int8 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.float32)
    unsigned = _UNSIGNED_OF_ITEMSIZE[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def _checksums(x: jax.Array) -> jax.Array:  # u32[4]
    words = _words(x)
    # Each word's row-major index, built from iotas in the weight's own shape: flattening
    # a sharded weight would gather it whole onto every device.
    index, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for axis in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        index = index + iota * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= words.shape[axis]
    index = index * jnp.uint32(0x9E3779B9)
    lanes = [_fmix32(words ^ _fmix32(index + jnp.uint32(s))) for s in _SALTS]
    return jnp.stack([jnp.sum(lane, dtype=jnp.uint32) for lane in lanes])


def model_fingerprint(config: Mapping[str, Any], weights: Sequence[Any]) -> bytes:
    """16 bytes naming `config` (JSON-serialisable) and `weights` (arrays, in a fixed
    order). Raises ValueError naming the weight when one is not a bool, int, float or
    PRNG key array (nnx state holds keys, e.g. a Dropout's). A weight that is not a
    jax.Array is named by `jnp.asarray(w)`: without jax_enable_x64 a 64-bit numpy array
    counts as its 32-bit conversion, so its dtype and dropped bits do not show."""
    arrays = []
    for i, w in enumerate(weights):
        dtype = getattr(w, "dtype", None)
        if dtype is None or not any(jnp.issubdtype(dtype, k) for k in _KINDS):
            raise ValueError(
                f"weights[{i}] must be an array of bool, int, float or PRNG keys, got {w!r:.80}"
            )
        arrays.append(w if isinstance(w, jax.Array) else jnp.asarray(w))
    digest = hashlib.blake2b(digest_size=FINGERPRINT_NUM_BYTES)
    digest.update(json.dumps(config, sort_keys=True).encode())
    for w in arrays:
        digest.update(f"|{w.shape}:{w.dtype}".encode())
    for sums in jax.device_get([_checksums(w) for w in arrays]):  # all dispatched first
        digest.update(np.asarray(sums).astype("<u4").tobytes())
    return digest.digest()
