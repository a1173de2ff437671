"""Device-mesh checks of the attention options per shard (registered into mesh_common.CHECKS).

Imported by tests/sharding/mesh_checks.py after it has set XLA_FLAGS (8 CPU host
devices); see there for how the checks run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import sharding
from jaxkv.attention import paged_attention, write_kv
from tests.sharding.mesh_common import BLOCK_SIZE, NUM_BLOCKS, check, max_diff, planned_step


@check
def attention_options_per_shard():
    """sharded_write_kv and sharded_paged_attention hand every option to each shard: an
    int8 cache with K and V scales, a soft cap and a sliding window at TP 4 equal the
    unsharded calls (the other checks use none of them, so a shard dropping one passed).
    Each option changes the unsharded result, so dropping any one shows."""
    rng = np.random.default_rng(4)
    step, md = planned_step(1, cascade=False)  # a sliding window excludes cascade levels
    valid = int(step.query_lens.sum())
    q = jnp.asarray(rng.standard_normal((md.max_num_tokens, 8, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((md.max_num_tokens, 4, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((md.max_num_tokens, 4, 8)), jnp.float32)
    kv = rng.integers(-100, 100, (NUM_BLOCKS, BLOCK_SIZE, 8, 8)).astype(np.int8)
    scales = dict(k_scale=0.03, v_scale=0.05)
    options = dict(sm_scale=0.5, soft_cap=1.0, sliding_window=3, **scales)
    want_kv = write_kv(jnp.asarray(kv), k, v, md.slot_mapping, **scales)
    want = paged_attention(q, want_kv, md, **options)
    mesh = sharding.make_mesh(4)
    cache = jax.device_put(kv, sharding.kv_cache_sharding(mesh))
    cache = sharding.sharded_write_kv(cache, k, v, md.slot_mapping, mesh=mesh, **scales)
    out = sharding.sharded_paged_attention(q, cache, md, mesh=mesh, **options)
    d = (max_diff(cache, want_kv), max_diff(out[:valid], want[:valid]))
    print(f"  int8 cache, scales, soft cap, window; TP=4: diff kv/out {d}")
    assert d[0] == 0.0 and d[1] < 1e-5, d
    # A quantized cache needs both scales: a shard that dropped one would raise, one that
    # passed another value would not.
    for name, value in (
        ("k_scale", 0.06),
        ("v_scale", 0.1),
        ("soft_cap", None),
        ("sliding_window", None),
    ):
        other = paged_attention(q, want_kv, md, **{**options, name: value})
        assert max_diff(other[:valid], want[:valid]) > 1e-3, f"{name} changes nothing here"
    for name in scales:
        other = write_kv(jnp.asarray(kv), k, v, md.slot_mapping, **{**scales, name: None})
        assert max_diff(other, want_kv) > 0, f"{name} changes nothing in the cache"
