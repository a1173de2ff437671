"""HostOffloadConnector serves one engine at a time; its store outlives the engine."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier, add, make_scheduler, run_until_idle, step

BS = 4


def _saved_connector(delay: int = 0):
    """A connector whose store holds a finished request's two full blocks."""
    copier = FakeCopier(32, BS)
    connector = HostOffloadConnector(1 << 20, copy_delay_steps=delay)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    add(sched, "a", list(range(1, 10)), max_tokens=1)
    return connector, copier, sched


def test_a_second_copier_is_refused_until_unbind():
    connector, copier, sched = _saved_connector()
    run_until_idle(sched, copier)
    stored = connector.stored_hashes()
    assert len(stored) == 2
    other = FakeCopier(32, BS)
    with pytest.raises(RuntimeError, match="serves another engine"):
        connector.check_can_bind()
    with pytest.raises(RuntimeError, match="serves another engine"):
        connector.bind(other, block_size=BS, hash_seed=0)
    assert connector.stored_hashes() == stored  # nothing changed
    connector.bind(copier, block_size=BS, hash_seed=0)  # its own copier again: fine

    connector.unbind(other)  # not the bound copier: nothing happens
    with pytest.raises(RuntimeError, match="serves another engine"):
        connector.bind(other, block_size=BS, hash_seed=0)
    connector.unbind(copier)
    connector.check_can_bind()
    assert connector.stats.stored_bytes == 2 * copier.bytes_per_block  # still counted
    connector.bind(other, block_size=BS, hash_seed=0)  # same layout: the store is kept
    assert connector.stored_hashes() == stored


def test_unbind_is_refused_while_a_copy_is_in_flight():
    connector, copier, sched = _saved_connector(delay=3)
    step(sched, copier)  # "a" finishes; its save lands three polls later
    assert connector.has_pending()
    with pytest.raises(RuntimeError, match="1 saves and 0 loads in flight"):
        connector.unbind(copier)
    with pytest.raises(RuntimeError, match="serves another engine"):
        connector.bind(FakeCopier(32, BS), block_size=BS, hash_seed=0)
    run_until_idle(sched, copier)
    connector.unbind(copier)
    assert len(connector.stored_hashes()) == 2


def test_a_closed_copier_is_unbound_with_its_copies_in_flight_forgotten():
    # An Engine.close that goes on past copies that never land (forced, or a step that
    # raised) unbinds its closed copier: refused, the connector served that closed
    # engine for good and refused every later one ("serves another engine").
    connector, copier, sched = _saved_connector(delay=10**9)
    step(sched, copier)  # "a" finishes; its save never lands
    assert connector.has_pending()
    copier.closed = True
    connector.unbind(copier)
    assert not connector.has_pending() and connector.hash_layout is None
    other = FakeCopier(32, BS)
    connector.bind(other, block_size=BS, hash_seed=0)
    # Its blocks are no longer "being saved": a request with the same ones saves them.
    assert connector.on_finish(_one_request("b", 8), [3, 4])
    assert other.saved_block_ids == [[3, 4]]


@pytest.mark.parametrize("closed", ["no", "False", 1, [0], lambda: False])
def test_only_a_closed_that_is_true_lets_unbind_forget_copies_in_flight(closed):
    # closed was read by its truth: a copier whose closed is a method, or text, was taken
    # as closed and its save in flight forgotten (counted failed, its blocks unsaved).
    connector, copier, sched = _saved_connector(delay=10**9)
    step(sched, copier)  # "a" finishes; its save is in flight
    copier.closed = closed
    with pytest.raises(RuntimeError, match="1 saves and 0 loads in flight"):
        connector.unbind(copier)
    assert connector.has_pending() and connector.hash_layout == (BS, 0)
    assert connector.stats.num_failed_saves == 0
    copier.closed = np.True_  # numpy's bool is a bool
    connector.unbind(copier)
    assert not connector.has_pending() and connector.hash_layout is None


@pytest.mark.parametrize(("block_size", "hash_seed"), [(2 * BS, 0), (BS, 1)])
def test_rebinding_the_bound_copier_under_another_layout_is_refused_mid_copy(block_size, hash_seed):
    # The save in flight, hashed under the old layout, used to land in the store emptied
    # for the new one: room taken by blocks no request of the new layout could load.
    copier = FakeCopier(16, BS, auto_complete=False)
    connector = HostOffloadConnector(1 << 20)
    connector.bind(copier, block_size=BS, hash_seed=0)
    assert connector.on_finish(_one_request("a", 8), [1, 2])
    copier.complete()
    assert connector.poll().saved == ("a",)
    stored = connector.stored_hashes()
    assert connector.on_finish(_one_request("b", 12), [3, 4, 5])  # a's blocks and one more
    with pytest.raises(RuntimeError, match="another layout while 1 saves and 0 loads"):
        connector.bind(copier, block_size=block_size, hash_seed=hash_seed)
    assert connector.hash_layout == (BS, 0) and connector.stored_hashes() == stored
    connector.bind(copier, block_size=BS, hash_seed=0)  # the same layout: fine
    copier.complete()
    assert connector.poll().saved == ("b",) and len(connector.stored_hashes()) == 3
    connector.bind(copier, block_size=block_size, hash_seed=hash_seed)  # nothing in flight
    assert connector.hash_layout == (block_size, hash_seed)
    assert connector.stored_hashes() == []


@pytest.mark.parametrize(
    ("block_size", "hash_seed", "bytes_per_block"),
    [(2 * BS, 0, None), (BS, 1, None), (BS, 0, 2 * 4 * BS)],
)
def test_binding_another_block_layout_empties_the_store(block_size, hash_seed, bytes_per_block):
    connector, copier, sched = _saved_connector()
    run_until_idle(sched, copier)
    connector.unbind(copier)
    other = FakeCopier(32, block_size)
    if bytes_per_block is not None:
        other.bytes_per_block = bytes_per_block
    connector.bind(other, block_size=block_size, hash_seed=hash_seed)
    assert connector.stored_hashes() == [] and connector.stats.num_stored_blocks == 0


def _one_request(request_id: str, num_tokens: int) -> Request:
    request = Request(request_id, list(range(1, num_tokens + 1)), SamplingParams())
    request.num_computed_tokens = num_tokens
    return request


@pytest.mark.parametrize(
    ("attr", "first", "other"),
    [
        ("block_shape", (BS,), (2, BS // 2)),
        ("dtype", np.dtype(np.float32), np.dtype(np.int32)),
        ("model_fingerprint", b"model-a", b"model-b"),
    ],
)
def test_a_copier_with_another_block_shape_dtype_or_model_empties_the_store(attr, first, other):
    # Same block size, seed and bytes per block: only `attr` tells the blocks apart.
    copiers = [FakeCopier(16, BS) for _ in range(3)]
    for copier, value in zip(copiers, (first, first, other), strict=True):
        setattr(copier, attr, value)
    connector = HostOffloadConnector(1 << 20)
    connector.bind(copiers[0], block_size=BS, hash_seed=0)
    assert connector.on_finish(_one_request("a", 8), [1, 2])
    connector.poll()
    connector.unbind(copiers[0])
    connector.bind(copiers[1], block_size=BS, hash_seed=0)  # the same value: kept
    assert len(connector.stored_hashes()) == 2
    connector.unbind(copiers[1])
    connector.bind(copiers[2], block_size=BS, hash_seed=0)
    assert connector.stored_hashes() == []


@pytest.mark.parametrize(
    ("name", "block_size", "hash_seed", "bytes_per_block"),
    [
        ("block_size", 0, 0, 4 * BS),
        ("block_size", -BS, 0, 4 * BS),
        ("block_size", float(BS), 0, 4 * BS),
        ("block_size", True, 0, 4 * BS),
        ("block_size", str(BS), 0, 4 * BS),
        ("hash_seed", BS, 1.5, 4 * BS),
        ("hash_seed", BS, None, 4 * BS),
        ("hash_seed", BS, 2**63, 4 * BS),
        ("hash_seed", BS, -(2**63) - 1, 4 * BS),
        ("bytes_per_block", BS, 0, 0),
        ("bytes_per_block", BS, 0, 16.0),
        ("bytes_per_block", BS, 0, None),
    ],
)
def test_bind_refuses_a_bad_layout_changing_nothing(name, block_size, hash_seed, bytes_per_block):
    # bind took any block_size, hash_seed or bytes_per_block: a bad one emptied the store
    # (another layout) and bound the copier, and the next hook failed far from the cause.
    connector, copier, sched = _saved_connector()
    run_until_idle(sched, copier)
    connector.unbind(copier)
    stored = connector.stored_hashes()
    other = FakeCopier(32, BS)
    other.bytes_per_block = bytes_per_block
    with pytest.raises(ValueError, match=name):
        connector.bind(other, block_size=block_size, hash_seed=hash_seed)
    assert connector.stored_hashes() == stored and connector.hash_layout is None
    connector.bind(copier, block_size=BS, hash_seed=0)  # still free to bind a good one
    assert connector.stored_hashes() == stored and connector.hash_layout == (BS, 0)


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1])
def test_bind_takes_the_extreme_64_bit_hash_seeds(seed):
    """Every seed that fits in 64 bits, as Request takes, binds, and the hooks hash with it."""
    copier = FakeCopier(16, BS)
    connector = HostOffloadConnector(1 << 20)
    connector.bind(copier, block_size=BS, hash_seed=seed)
    assert connector.hash_layout == (BS, seed)
    assert connector.on_finish(_one_request("a", 8), [1, 2])
    connector.poll()
    probe = Request("p", list(range(1, 10)), SamplingParams())
    assert connector.on_admission(probe, 0) == 2 * BS
    assert connector.stored_hashes() == probe.update_block_hashes(BS, seed)[1::-1]


def test_unbind_is_refused_while_a_load_is_in_flight():
    """A load still writing into the engine's cache holds the binding as a save does."""
    copier = FakeCopier(16, BS, auto_complete=False)
    connector = HostOffloadConnector(1 << 20)
    connector.bind(copier, block_size=BS, hash_seed=0)
    assert connector.on_finish(_one_request("a", 8), [1, 2])
    copier.complete()
    connector.poll()
    probe = Request("p", list(range(1, 10)), SamplingParams())
    assert connector.on_admission(probe, 0) == 2 * BS
    connector.start_load(probe, [3, 4])
    with pytest.raises(RuntimeError, match="0 saves and 1 loads in flight"):
        connector.unbind(copier)
    assert connector.hash_layout == (BS, 0)  # still bound
    copier.complete()
    assert connector.poll().loaded == ("p",)
    connector.unbind(copier)
    assert connector.hash_layout is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("block_shape", BS),
        ("block_shape", str(BS)),
        ("block_shape", (float(BS),)),
        ("block_shape", (-BS,)),
        ("block_shape", (BS, 0)),  # no byte to hold: no save would ever land
        ("dtype", "not a dtype"),
        ("dtype", object()),
    ],
)
def test_bind_refuses_a_block_shape_or_dtype_it_cannot_check_blocks_by(name, value):
    # bind took any, though no array has such a shape or dtype to tell its blocks by.
    connector, copier, sched = _saved_connector()
    run_until_idle(sched, copier)
    connector.unbind(copier)
    stored = connector.stored_hashes()
    other = FakeCopier(32, BS)
    setattr(other, name, value)
    with pytest.raises(ValueError, match=f"copier.{name}="):
        connector.bind(other, block_size=BS, hash_seed=0)
    assert connector.stored_hashes() == stored and connector.hash_layout is None


def test_copiers_declaring_one_block_layout_in_other_words_share_the_store():
    # A dtype given as a scalar type or its name, a shape as a list or numpy ints: the
    # same blocks. The store was emptied when the words differed.
    first, second = FakeCopier(16, BS), FakeCopier(16, BS)
    first.block_shape, first.dtype = (BS,), np.float32
    second.block_shape, second.dtype = [np.int64(BS)], "float32"
    connector = HostOffloadConnector(1 << 20)
    connector.bind(first, block_size=BS, hash_seed=0)
    assert connector.on_finish(_one_request("a", 8), [1, 2])
    assert connector.poll().saved == ("a",)
    connector.unbind(first)
    connector.bind(second, block_size=BS, hash_seed=0)
    assert len(connector.stored_hashes()) == 2
    assert connector.on_finish(_one_request("b", 12), [1, 2, 3])  # its blocks pass the check
    assert connector.poll().saved == ("b",) and len(connector.stored_hashes()) == 3


def test_an_unbound_connector_claims_nothing_from_the_store_it_keeps():
    # The store outlives its engine, and on_admission kept claiming it: start_load then
    # refused each claim (no copier), so every schedule() raised and the request waited
    # for good. Unbound, or its copier collected, it claims nothing until bound again.
    connector, copier, sched = _saved_connector()
    run_until_idle(sched, copier)
    stored = connector.stored_hashes()
    assert len(stored) == 2
    connector.unbind(copier)
    probe = Request("probe", list(range(1, 10)), SamplingParams())
    assert connector.on_admission(probe, 0) == 0
    other = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    add(other, "b", list(range(1, 10)), max_tokens=1)
    out = other.schedule()
    assert out.request_ids == ["b"] and out.num_scheduled_tokens.tolist() == [9]
    assert connector.stored_hashes() == stored and connector.stats.num_failed_loads == 0
    again = FakeCopier(32, BS)
    connector.bind(again, block_size=BS, hash_seed=0)
    assert connector.on_admission(probe, 0) == 8
    del again
    gc.collect()
    assert connector.on_admission(probe, 0) == 0


def test_bind_refuses_a_block_shape_with_numpys_wildcard_dimension():
    # reshape reads -1 as "whatever fits"; no array has a dimension of -1.
    connector = HostOffloadConnector(1 << 20)
    copier = FakeCopier(16, BS)
    copier.block_shape = (1, -1)
    with pytest.raises(ValueError, match=r"copier.block_shape=\(1, -1\) must be a sequence"):
        connector.bind(copier, block_size=BS, hash_seed=0)
    assert connector.hash_layout is None


@pytest.mark.parametrize(
    ("block_shape", "dtype", "bytes_per_block", "match"),
    [
        (
            (BS, 2),
            np.float32,
            BS * 4,
            r"block_shape=\(4, 2\) of copier.dtype=float32 holds 32 bytes",
        ),
        ((BS,), np.float64, BS * 4, r"holds 32 bytes, not copier.bytes_per_block=16"),
        ((3,), None, BS * 4, r"bytes_per_block=16 must be a whole number of .*\(3,\)'s 3 elements"),
        (None, np.float64, 12, r"bytes_per_block=12 must be a whole number of .*float64's 8-byte"),
    ],
)
def test_bind_refuses_a_declared_block_that_cannot_hold_bytes_per_block(
    block_shape, dtype, bytes_per_block, match
):
    # Every block such a copier saved would be refused when it landed, each save lost
    # with a warning; bind can tell at once.
    connector, copier, sched = _saved_connector()
    run_until_idle(sched, copier)
    connector.unbind(copier)
    stored = connector.stored_hashes()
    other = FakeCopier(32, BS)
    other.block_shape, other.dtype, other.bytes_per_block = block_shape, dtype, bytes_per_block
    with pytest.raises(ValueError, match=match):
        connector.bind(other, block_size=BS, hash_seed=0)
    assert connector.stored_hashes() == stored and connector.hash_layout is None
    other.block_shape, other.dtype = (BS, 2), np.float16  # 16 bytes: bound
    other.bytes_per_block = BS * 4
    connector.bind(other, block_size=BS, hash_seed=0)
