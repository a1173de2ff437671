"""The root hash's default seed is the manager's default hash_seed, 0."""

from __future__ import annotations

from jaxkv.hashing import root_hash


def test_root_hash_defaults_to_seed_zero():
    assert root_hash() == root_hash(0)
    assert root_hash() not in (root_hash(1), root_hash(-1))
