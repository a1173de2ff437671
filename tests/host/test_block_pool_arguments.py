"""BlockPool.cache_full_blocks names arguments of the wrong kind with ValueError, as the
pool's other calls do, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.block_pool import BlockPool
from jaxkv.hashing import root_hash
from jaxkv.request import MAX_TOKEN_ID

H = root_hash(7)


@pytest.mark.parametrize(
    "args, match",
    [
        ((None, [H], [1, 2]), "blocks=None must be an iterable of blocks"),
        (("one", [H], [1, 2]), "blocks=KVCacheBlock.* must be an iterable of blocks"),
        ((None, None, None), "blocks=None must be an iterable of blocks"),
        (("held", None, [1, 2]), "block_hashes=None and token_ids=.* must be sequences"),
        (("held", [H], None), "block_hashes=.* and token_ids=None must be sequences"),
        (("held", (h for h in [H]), [1, 2]), "block_hashes=<generator"),
    ],
)
def test_cache_full_blocks_refuses_arguments_of_another_kind_by_name(args, match):
    # len() of None, of one block or of a generator raised TypeError naming no argument.
    pool = BlockPool(4, enable_events=True)
    held = pool.get_new_blocks(1)
    blocks, hashes, tokens = args
    blocks = held if blocks == "held" else held[0] if blocks == "one" else blocks
    with pytest.raises(ValueError, match=match):
        pool.cache_full_blocks(
            blocks, hashes, parent_block_hash=None, token_ids=tokens, block_size=2,
            adapter_id=None,
        )  # fmt: skip
    assert held[0].block_hash is None and not pool.cached_block_hash_to_block
    assert pool.take_events() == []
    pool.check_integrity({held[0].block_id: 1})


def test_cache_full_blocks_takes_its_blocks_from_a_generator():
    pool = BlockPool(4, enable_events=True)
    held = pool.get_new_blocks(1)
    pool.cache_full_blocks(
        (b for b in held), [H], parent_block_hash=None, token_ids=[1, 2], block_size=2,
        adapter_id=None,
    )  # fmt: skip
    assert held[0].block_hash == H and [e.block_hashes for e in pool.take_events()] == [(H,)]
    pool.check_integrity({held[0].block_id: 1})


@pytest.mark.parametrize(
    "tokens",
    [["a", "b"], "ab", b"ab", bytearray(b"ab"), [1.5, 2], [True, 2], [-1, 2], [2**63, 2]],
)
def test_cache_full_blocks_refuses_token_ids_no_request_holds(tokens):
    # They went into the BlockStored event as given, for a router to hash.
    pool = BlockPool(4, enable_events=True)
    held = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="token_ids"):
        pool.cache_full_blocks(
            held, [H], parent_block_hash=None, token_ids=tokens, block_size=2, adapter_id=None
        )
    assert held[0].block_hash is None and not pool.cached_block_hash_to_block
    assert pool.take_events() == []
    pool.check_integrity({held[0].block_id: 1})


def test_cache_full_blocks_stores_numpy_token_ids_as_python_ints():
    pool = BlockPool(4, enable_events=True)
    held = pool.get_new_blocks(1)
    pool.cache_full_blocks(
        held, [H], parent_block_hash=None, token_ids=np.array([3, 4]), block_size=2,
        adapter_id=None,
    )  # fmt: skip
    (event,) = pool.take_events()
    assert event.token_ids == (3, 4) and set(map(type, event.token_ids)) == {int}


def test_cache_full_blocks_takes_the_least_and_the_greatest_token_id():
    pool = BlockPool(4, enable_events=True)
    held = pool.get_new_blocks(1)
    pool.cache_full_blocks(
        held, [H], parent_block_hash=None, token_ids=[0, MAX_TOKEN_ID], block_size=2,
        adapter_id=None,
    )  # fmt: skip
    (event,) = pool.take_events()
    assert event.token_ids == (0, 2**63 - 1) and held[0].block_hash == H
