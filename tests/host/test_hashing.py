"""Chained block hashes: determinism, chaining, extra keys, cross-process stability."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jaxkv import KVCacheManager, hashing
from jaxkv.hashing import (
    HASH_NUM_BYTES,
    block_extra_keys,
    check_hash_key,
    extend_block_hashes,
    hash_block_tokens,
    root_hash,
)
from jaxkv.request import Request


def test_digest_is_128_bits_and_deterministic():
    h = hash_block_tokens(root_hash(0), [1, 2, 3, 4])
    assert len(h) == HASH_NUM_BYTES == 16
    assert h == hash_block_tokens(root_hash(0), (1, 2, 3, 4))


def test_every_input_changes_the_hash():
    base = hash_block_tokens(root_hash(0), [1, 2, 3, 4])
    assert hash_block_tokens(root_hash(1), [1, 2, 3, 4]) != base  # seed
    assert hash_block_tokens(root_hash(0), [1, 2, 3, 5]) != base  # a token
    assert hash_block_tokens(root_hash(0), [1, 2, 3, 4], ("adapter:a",)) != base
    parent = hash_block_tokens(root_hash(0), [9, 9, 9, 9])
    assert hash_block_tokens(parent, [1, 2, 3, 4]) != base  # parent


def test_encoding_is_unambiguous_between_tokens_and_keys():
    # Length prefixes keep ("ab",) apart from ("a", "b") and token 0 apart from no token.
    p = root_hash(0)
    assert hash_block_tokens(p, [1], ("ab",)) != hash_block_tokens(p, [1], ("a", "b"))
    assert hash_block_tokens(p, [0]) != hash_block_tokens(p, [])


def test_chain_names_the_whole_prefix():
    tokens = list(range(12))
    hashes = extend_block_hashes([], tokens, 4)
    assert len(hashes) == 3
    h0 = hash_block_tokens(root_hash(0), tokens[0:4])
    h1 = hash_block_tokens(h0, tokens[4:8])
    assert hashes[:2] == [h0, h1]
    other = extend_block_hashes([], [99] + tokens[1:], 4)
    assert all(a != b for a, b in zip(hashes, other, strict=True))  # first block differs


@pytest.mark.parametrize("keys", [{}, {"adapter_id": "a", "cache_salt": "s"}])
def test_extend_is_incremental_and_ignores_partial_blocks(keys):
    # The salt is block 0's key only, also when a later call adds blocks 1 and 2.
    tokens = list(range(14))
    hashes = extend_block_hashes([], tokens[:6], 4, **keys)
    assert len(hashes) == 1
    extend_block_hashes(hashes, tokens, 4, **keys)
    assert hashes == extend_block_hashes([], tokens, 4, **keys)


def test_salt_on_first_block_only_adapter_on_every_block():
    assert block_extra_keys(0, adapter_id=None, cache_salt="s") == ("salt:s",)
    assert block_extra_keys(1, adapter_id=None, cache_salt="s") == ()
    assert block_extra_keys(0, adapter_id="lora", cache_salt="s") == ("adapter:lora", "salt:s")
    assert block_extra_keys(5, adapter_id="lora", cache_salt="s") == ("adapter:lora",)


def test_request_hashes_depend_on_salt_and_adapter():
    tokens = list(range(8))
    plain = Request("a", tokens).update_block_hashes(4)
    salted = Request("b", tokens, cache_salt="s").update_block_hashes(4)
    adapted = Request("c", tokens, adapter_id="x").update_block_hashes(4)
    assert len({plain[0], salted[0], adapted[0]}) == 3
    assert len({plain[1], salted[1], adapted[1]}) == 3  # salt reaches block 1 via the chain


def test_request_refuses_a_second_block_size():
    req = Request("a", range(8))
    req.update_block_hashes(4)
    with pytest.raises(ValueError, match="block_size, seed"):
        req.update_block_hashes(2)


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1, True, 1.0, "0"])
def test_root_hash_rejects_bad_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        root_hash(seed)


def test_root_hash_takes_every_int64_seed_and_tells_them_apart():
    seeds = [-(2**63), -1, 0, 1, 2**63 - 1]
    assert len({root_hash(s) for s in seeds}) == len(seeds)


@pytest.mark.parametrize("tokens", [[1, 2**63], [1, 2.5], [-(2**63) - 1]])
def test_hash_block_tokens_rejects_tokens_outside_int64(tokens):
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(root_hash(0), tokens)
    with pytest.raises(ValueError, match="token_ids"):
        extend_block_hashes([], [7, *tokens], len(tokens) + 1)


@pytest.mark.parametrize("token", [True, False, np.True_])
def test_bool_tokens_are_refused_as_a_request_refuses_them(token):
    # struct packs True as 1: the hash of [1, True] was that of [1, 1].
    with pytest.raises(ValueError, match=r"token_ids.*not bools"):
        hash_block_tokens(root_hash(0), [1, token])
    hashes = extend_block_hashes([], [1, 2], 2)
    with pytest.raises(ValueError, match=r"token_ids.*not bools"):
        extend_block_hashes(hashes, [1, 2, 3, token, 5], 2)
    assert hashes == extend_block_hashes([], [1, 2], 2)  # nothing appended


@pytest.mark.parametrize("name", ["adapter_id", "cache_salt"])
@pytest.mark.parametrize("key", [5, b"x", ["x"], "\ud800"])
def test_extend_names_a_key_that_cannot_be_hashed(name, key):
    # TypeError ("can only concatenate str"), "unhashable type" or UnicodeEncodeError
    # used to name neither argument.
    hashes = extend_block_hashes([], [1, 2], 2)
    with pytest.raises(ValueError, match=f"{name}="):
        extend_block_hashes(hashes, [1, 2, 3, 4], 2, **{name: key})
    assert hashes == extend_block_hashes([], [1, 2], 2)


class _UnhashableStr(str):
    __hash__ = None  # a str all the same: a Request takes it as a salt or adapter id


@pytest.mark.parametrize("name", ["adapter_id", "cache_salt"])
def test_a_str_subclass_without_a_hash_is_hashed_as_the_str_it_holds(name):
    # A Request took it, then every allocation raised TypeError "unhashable type" from
    # the memo of the key encodings.
    tokens = list(range(8))
    want = extend_block_hashes([], tokens, 4, **{name: "k"})
    assert extend_block_hashes([], tokens, 4, **{name: _UnhashableStr("k")}) == want
    manager = KVCacheManager(16, 4, max_model_len=32)
    request = Request("r", tokens, **{name: _UnhashableStr("k")})
    assert manager.allocate_slots(request, 8) is not None
    assert request.block_hashes == want


@pytest.mark.parametrize("extra_keys", ["ab", ["a"], (5,), ("\ud800",)])
def test_hash_block_tokens_takes_a_tuple_of_keys_only(extra_keys):
    # "ab" was hashed as the keys ("a", "b"); 5 raised AttributeError.
    with pytest.raises(ValueError, match="extra_keys=.* must be a tuple of str"):
        hash_block_tokens(root_hash(0), [1], extra_keys)


@pytest.mark.parametrize("block_size", [0, -2, 2.0, "2", True, None])
def test_extend_refuses_a_block_size_that_is_no_positive_int(block_size):
    # 0 raised ZeroDivisionError and -2 answered "no full block" without a word.
    hashes = extend_block_hashes([], [1, 2, 3, 4], 2)
    with pytest.raises(ValueError, match="block_size"):
        extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6], block_size)
    assert hashes == extend_block_hashes([], [1, 2, 3, 4], 2)


def test_extend_takes_a_numpy_int_block_size():
    assert extend_block_hashes([], [1, 2, 3, 4], np.int64(2)) == extend_block_hashes(
        [], [1, 2, 3, 4], 2
    )


def test_extend_hashes_every_int64_token_as_hash_block_tokens_does():
    tokens = [-(2**63), -1, 0, 2**63 - 1]
    assert extend_block_hashes([], tokens, 4) == [hash_block_tokens(root_hash(0), tokens)]


@pytest.mark.parametrize("adapter_id", [None, "a", ""])
@pytest.mark.parametrize("cache_salt", [None, "s", "é"])
def test_extend_equals_chaining_hash_block_tokens_with_every_key(adapter_id, cache_salt):
    # The fast path encodes blocks itself: it must stay the specification's chain, with
    # the adapter id on every block and the salt on block 0 only, from two starting points.
    tokens, seed = list(range(13)), 5
    chain, parent = [], root_hash(seed)
    for i in range(3):
        keys = block_extra_keys(i, adapter_id=adapter_id, cache_salt=cache_salt)
        parent = hash_block_tokens(parent, tokens[4 * i : 4 * i + 4], keys)
        chain.append(parent)
    keys = dict(seed=seed, adapter_id=adapter_id, cache_salt=cache_salt)
    assert extend_block_hashes([], tokens, 4, **keys) == chain
    assert extend_block_hashes(chain[:1], tokens, 4, **keys) == chain


# Loads hashing.py by path (it imports only the standard library) so the child process
# does not pay for importing the rest of the package.
_SNIPPET = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("h", sys.argv[1])
h = importlib.util.module_from_spec(spec)
spec.loader.exec_module(h)
hashes = h.extend_block_hashes([], list(range(9)), 4, seed=7, adapter_id="a", cache_salt="s")
print(b"".join(hashes).hex())
"""


def test_hashes_are_stable_across_processes():
    here = b"".join(
        extend_block_hashes([], list(range(9)), 4, seed=7, adapter_id="a", cache_salt="s")
    ).hex()
    outs = set()
    for hash_seed in ("1", "2"):  # different PYTHONHASHSEED must not matter
        env = {"PYTHONHASHSEED": hash_seed}
        res = subprocess.run(
            [sys.executable, "-c", _SNIPPET, hashing.__file__],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        outs.add(res.stdout.strip())
    assert outs == {here}


def test_digests_are_pinned():
    """The encoding is fixed: a change would orphan every block stored under the old one."""
    hashes = extend_block_hashes(
        [], list(range(40)), 4, seed=7, adapter_id="lora-a", cache_salt="s1"
    )
    assert hashes[0].hex() == "c61c6588bcfd52ed27cb304eea2175f5"
    assert hashes[-1].hex() == "d56cc4dc7d75b408d1fb0ea9aae9760e"
    plain = extend_block_hashes([], list(range(100, 140)), 16)
    assert plain[-1].hex() == "16ca569b08e9acb46c2b94a046b6c5e5"
    assert plain[0] == hash_block_tokens(root_hash(0), list(range(100, 116)))


def test_digests_of_non_ascii_keys_are_pinned():
    """Keys are length-prefixed by their UTF-8 byte count, not their character count: a
    change would orphan every block stored under a non-ASCII adapter id or salt."""
    hashes = extend_block_hashes([], list(range(8)), 4, adapter_id="lora-é", cache_salt="sël")
    assert [h.hex() for h in hashes] == [
        "8e3ecf90fc1642c34aeb5766db6ebbd0",
        "68b87c96e7809cc15a12ff0e3e4bf0bb",
    ]


@pytest.mark.parametrize("key", [7, b"s", "tenant-\ud800"])
def test_check_hash_key_refuses_what_cannot_be_hashed_by_name(key):
    """check_hash_key names the argument for a non-str and for a str UTF-8 cannot encode
    (a lone surrogate), and takes None and any encodable str."""
    with pytest.raises(ValueError, match="cache_salt=.* must be None or a str"):
        check_hash_key("cache_salt", key)
    check_hash_key("cache_salt", None)
    check_hash_key("cache_salt", "tenant-é")


@pytest.mark.parametrize("parent", [b"\0" * (HASH_NUM_BYTES - 1), b"\0" * (HASH_NUM_BYTES + 1)])
def test_hash_block_tokens_rejects_a_parent_that_is_not_a_block_hash(parent):
    with pytest.raises(ValueError):
        hash_block_tokens(parent, [1, 2])


def test_extending_known_hashes_chains_from_the_last_one():
    # Two known hashes, then two more blocks: the same as hashing all four at once. A
    # chain from the first hash would give block 2 of prompts that differ only in block
    # 1 the same hash, so one could be served the other's KV.
    tokens = list(range(16))
    partial = extend_block_hashes([], tokens[:8], 4)
    assert extend_block_hashes(partial, tokens, 4) == extend_block_hashes([], tokens, 4)
    a = extend_block_hashes([], [1] * 4 + [2] * 4, 4)
    b = extend_block_hashes([], [1] * 4 + [3] * 4, 4)
    extend_block_hashes(a, [1] * 4 + [2] * 4 + [7] * 4, 4)
    extend_block_hashes(b, [1] * 4 + [3] * 4 + [7] * 4, 4)
    assert a[2] != b[2]


def test_blocks_filled_by_decode_tokens_hit_like_the_same_prompt_at_once():
    m = KVCacheManager(32, 4, max_model_len=64)
    r = Request("a", list(range(9)))
    assert m.allocate_slots(r, 9) is not None
    r.num_computed_tokens = 9
    for t in range(100, 108):  # fills blocks 2 and 3 one decode token at a time
        r.append_output_token_ids([t])
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    fresh = Request("b", [*range(9), *range(100, 108), 5])
    assert m.get_computed_blocks(fresh) == (m.block_ids("a")[:4], 16)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: hash_block_tokens(None, [1, 2]), "parent_hash=None must be a BlockHash"),
        (lambda: hash_block_tokens("p" * HASH_NUM_BYTES, [1]), "parent_hash='pppp"),
        (lambda: hash_block_tokens(root_hash(0), 5), "token_ids=5 must be ints"),
        (lambda: extend_block_hashes(None, [1, 2], 2), "block_hashes=None must be a list"),
        (lambda: extend_block_hashes((), [1, 2], 2), r"block_hashes=\(\) must be a list"),
        (lambda: extend_block_hashes([b"x"], [1] * 4, 2), r"block_hashes\[-1\]=b'x' must be"),
    ],
)
def test_a_parent_or_a_chain_that_is_no_block_hash_is_refused_by_name(call, match):
    # These raised TypeError ("object of type 'NoneType' has no len()", "can only
    # concatenate str"), naming no argument; a chain extended from a parent that is no
    # digest (b"x") was hashed as if it named a prefix.
    with pytest.raises(ValueError, match=match):
        call()


def test_a_refused_chain_is_left_as_it_was():
    hashes = [b"x"]
    with pytest.raises(ValueError):
        extend_block_hashes(hashes, [1] * 4, 2)
    assert hashes == [b"x"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cache_salt": 5}, "cache_salt=5"),
        ({"adapter_id": "\ud800"}, "adapter_id="),
        ({"block_hashes": [b"x"]}, r"block_hashes\[-1\]=b'x' must be"),
    ],
)
@pytest.mark.parametrize("tokens", [[1], [1, 2, 3]], ids=["no-full-block", "chain-complete"])
def test_arguments_are_refused_when_no_block_is_left_to_hash(kwargs, match, tokens):
    # A prompt shorter than a block, or a chain that already covers every full block,
    # returned the chain unchecked: a key or parent that a longer prompt has refused.
    kwargs = dict(kwargs)
    hashes = kwargs.pop("block_hashes", extend_block_hashes([], tokens, 2))
    before = list(hashes)
    with pytest.raises(ValueError, match=match):
        extend_block_hashes(hashes, tokens, 2, **kwargs)
    assert hashes == before


def test_a_numpy_block_size_of_one_hashes_as_the_int_one():
    tokens = [5, 6, 7]
    want = hashing.extend_block_hashes([], tokens, 1)
    assert len(want) == 3
    assert hashing.extend_block_hashes([], tokens, np.int64(1)) == want


def test_the_parent_checked_is_the_last_hash_of_the_list_not_the_first():
    good = hashing.extend_block_hashes([], [1, 2, 3, 4], 2)
    with pytest.raises(ValueError, match=r"^block_hashes\[-1\]='bad' must be a BlockHash"):
        hashing.extend_block_hashes([good[0], "bad"], [1, 2, 3, 4, 5, 6], 2)
    extended = hashing.extend_block_hashes(list(good), [1, 2, 3, 4, 5, 6], 2)
    assert extended[:2] == good and len(extended) == 3


@pytest.mark.parametrize("key", [5, None, "\ud800"])
def test_is_hash_key_answers_false_as_a_bool(key):
    assert hashing.is_hash_key(key) is False
