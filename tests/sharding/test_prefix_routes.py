"""PrefixRoutes keys a prompt as the replicas' prefix caches do (jaxkv.hashing's chained
block hashes under the router's hash_seed and the request's cache_salt), so a route
names the prefix a replica has cached."""

from __future__ import annotations

from jaxkv import CacheConfig
from jaxkv.hashing import extend_block_hashes
from jaxkv.prefix_routes import PrefixRoutes
from jaxkv.router import PrefixAwareRouter
from tests.sharding._router_util import BLOCK, FakeReplica


def test_the_keys_are_the_prefix_caches_under_the_hash_seed_and_salt():
    prompt = list(range(3 * BLOCK + 1))
    for seed in (0, 7, -(2**63)):
        routes = PrefixRoutes(BLOCK, max_prefix_blocks=2, max_tracked_prefixes=8, hash_seed=seed)
        for salt in (None, "tenant"):
            want = extend_block_hashes([], prompt[: 2 * BLOCK], BLOCK, seed=seed, cache_salt=salt)
            assert routes.hashes(prompt, salt) == want
    seeded = PrefixRoutes(BLOCK, 2, 8, hash_seed=7).hashes(prompt, None)
    assert seeded != PrefixRoutes(BLOCK, 2, 8, hash_seed=0).hashes(prompt, None)


def test_a_routers_default_hash_seed_is_the_default_cache_configs():
    """Over Engines built with the default CacheConfig, a router built with its defaults
    keys each prompt as their prefix caches do: a route names a prefix a replica cached."""
    router = PrefixAwareRouter([FakeReplica(0)], block_size=BLOCK)
    assert router.hash_seed == CacheConfig().hash_seed
    prompt = list(range(2 * BLOCK))
    router.add_request(prompt)
    want = extend_block_hashes([], prompt, BLOCK, seed=CacheConfig().hash_seed)
    assert router._routes.longest(want) == (0, 2)
