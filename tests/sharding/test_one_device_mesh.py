"""An engine on a mesh of one device (engine_replicas' default: one replica per device)
runs every step on the caches in the sharding they were made with: jax's cache of the step
program then holds no entry beyond the programs the engine counts."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxkv import SamplingParams
from jaxkv.router import engine_replicas
from tests.engine._util import VOCAB, engine_config, tiny_model


def test_the_caches_keep_their_sharding_and_jax_caches_only_counted_programs():
    (engine,) = engine_replicas(tiny_model(), engine_config(), num_replicas=1)
    with engine:
        assert engine.mesh.devices.size == 1
        initial = engine.kv_caches[0].sharding
        # Over one device the split along heads is none: the form jit returns the caches in.
        assert initial.spec == P()
        before = engine._program._cache_size()
        rng = np.random.default_rng(0)
        for _ in range(3):
            prompt = rng.integers(0, VOCAB, int(rng.integers(2, 12))).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=3))
        while engine.has_unfinished_requests():
            engine.step()
            # P(None, None, "model") came back as P(): the second step missed jit's cache.
            assert engine.kv_caches[0].sharding == initial, engine.kv_caches[0].sharding
        assert 0 < engine._program._cache_size() - before <= engine.num_compiles
    assert isinstance(initial, jax.sharding.NamedSharding)
