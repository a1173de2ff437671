"""A step shape compiles once, whatever last replaced the KV caches.

jit compiles a program again for committed arguments where it compiled it for
uncommitted ones. A KV load's scatter (jaxkv.kv_copy) returns committed caches, and so
does a step over committed weights: before the engine committed its caches from the
start, every step shape met both before and after that compiled twice, beyond
Engine.num_compiles and EngineConfig.max_step_programs.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxkv import SamplingParams
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxkv.engine import Engine
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.engine._util import BLOCK_SIZE, MAX_MODEL_LEN, tiny_model

MAX_TOKENS = 16
MAX_SEQS = 4


def _config(num_blocks: int) -> EngineConfig:
    """Every bucket pinned, cascade off: each step of each test runs one program. Cache
    sizes no other test uses, so that the programs compile here."""
    return EngineConfig(
        cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS, max_model_len=MAX_MODEL_LEN
        ),
        backend="xla",
        enable_cascade=False,
        min_num_tokens_bucket=MAX_TOKENS,
        min_num_seqs_bucket=MAX_SEQS,
        min_pages_bucket=MAX_MODEL_LEN // BLOCK_SIZE,
        q_len_buckets=(MAX_TOKENS,),
    )


def test_a_kv_load_does_not_compile_the_step_program_again():
    connector = HostOffloadConnector(1 << 20)
    engine = Engine(tiny_model(), None, _config(52), connector=connector)
    prompt = list(range(1, 14))  # three full blocks to save, and load back
    engine.generate([prompt], SamplingParams(max_tokens=2), progress=False)
    engine.drain_transfers()
    assert engine.reset_prefix_cache()
    compiled = engine._program._cache_size()

    engine.generate([prompt], SamplingParams(max_tokens=2), progress=False)

    assert connector.stats.num_loads == 1
    assert engine.num_compiles == 1
    assert engine._program._cache_size() == compiled


def test_a_step_over_committed_weights_compiles_its_program_once():
    model = tiny_model()
    params = jax.device_put(nnx.state(model), jax.devices()[0])
    engine = Engine(model, params, _config(54))
    before = engine._program._cache_size()

    engine.generate([list(range(1, 10))], SamplingParams(max_tokens=4), progress=False)

    assert engine.num_compiles == 1
    assert engine._program._cache_size() - before == 1
