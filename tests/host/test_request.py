"""Request, RequestStatus and SamplingParams."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request, RequestStatus, SamplingParams
from jaxkv.hashing import extend_block_hashes


def test_request_tracks_tokens():
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=4))
    assert (req.num_tokens, req.num_prompt_tokens, req.max_tokens) == (3, 3, 4)
    assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
    req.append_output_token_ids([8, 9])
    req.append_output_token_ids(10)
    assert list(req.all_token_ids) == [5, 6, 7, 8, 9, 10]
    assert req.output_token_ids == [8, 9, 10] and req.prompt_token_ids == (5, 6, 7)
    assert req.num_tokens == 6 and req.num_output_tokens == 3


def test_block_hashes_extend_lazily_as_tokens_arrive():
    req = Request("r", range(6))
    assert req.block_hashes == []  # nothing computed until asked
    assert len(req.update_block_hashes(4)) == 1
    first = req.block_hashes[0]
    req.append_output_token_ids([6, 7])
    assert len(req.update_block_hashes(4)) == 2 and req.block_hashes[0] == first


def test_status_is_finished():
    finished = {s for s in RequestStatus if s.is_finished()}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_TRANSFERRING,
    }
    assert RequestStatus.is_finished(RequestStatus.FINISHED_TRANSFERRING)
    req = Request("r", [1])
    req.status = RequestStatus.PREEMPTED
    assert not req.is_finished()


def test_a_request_is_finished_exactly_when_its_status_is():
    req = Request("r", [1])
    for status in RequestStatus:
        req.status = status
        assert req.is_finished() is status.is_finished()


def test_sampling_params_defaults_and_frozen():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop_token_ids) == (
        16,
        0.0,
        0,
        1.0,
        None,
        (),
    )
    assert SamplingParams(stop_token_ids=[2, 3]).stop_token_ids == (2, 3)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # vLLM's default
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"; other negatives count
    assert SamplingParams(seed=np.int64(-1)).seed is None
    assert SamplingParams(seed=-2).seed == -2
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 3


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -2),  # -1 is vLLM's "off"
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", 1.5),
        ("stop_token_ids", (-1,)),
        ("max_tokens", True),
        ("temperature", "hot"),
        ("top_p", None),
        ("stop_token_ids", (1.0,)),
        ("stop_token_ids", {7: "eos"}),  # a mapping: its keys passed for the ids
        ("stop_token_ids", b"\x07\x08"),  # bytes: their values passed for the ids
        ("stop_token_ids", bytearray(b"\x07")),
    ],
)
def test_sampling_params_reject_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_take_numpy_numbers_as_python_ones():
    p = SamplingParams(
        max_tokens=np.int64(5),
        temperature=np.float32(0.5),
        top_k=np.uint8(3),
        top_p=np.float64(0.9),
        seed=np.int32(7),
        stop_token_ids=np.array([1, 2]),
    )
    assert p == SamplingParams(
        max_tokens=5, temperature=0.5, top_k=3, top_p=0.9, seed=7, stop_token_ids=(1, 2)
    )
    assert all(type(v) is int for v in (p.max_tokens, p.top_k, p.seed, *p.stop_token_ids))
    assert type(p.temperature) is float and type(p.top_p) is float
    assert type(SamplingParams(temperature=1, top_p=1).temperature) is float


def test_a_block_size_of_1_is_taken_as_a_numpy_integer_and_the_seed_defaults_to_0():
    req, expected = Request("r", range(3)), Request("s", range(3)).update_block_hashes(1)
    req.check_hash_config(np.int64(1))
    assert req.update_block_hashes(np.int64(1), np.uint8(0)) == expected
    assert req.check_hash_config(1) is None  # the config hashed: (1, 0)
    with pytest.raises(ValueError, match=r"=\(1, 0\), not \(1, 1\)"):
        req.check_hash_config(1, 1)


def test_sampling_params_bounds_are_exact():
    f32_max = float(np.finfo(np.float32).max)
    assert SamplingParams(temperature=f32_max).temperature == f32_max  # finite in float32
    assert SamplingParams(stop_token_ids=[0]).stop_token_ids == (0,)
    with pytest.raises(ValueError, match="^temperature="):
        SamplingParams(temperature=float(np.nextafter(np.float64(f32_max), np.inf)) * 2)


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1])
def test_a_hash_seed_at_either_end_of_64_bits_is_taken(seed):
    req = Request("r", range(9))
    req.check_hash_config(4, seed)
    assert req.update_block_hashes(4, seed) == Request("s", range(9)).update_block_hashes(4, seed)
    for outside in (-(2**63) - 1, 2**63):
        with pytest.raises(ValueError, match="fits in 64 bits"):
            Request("t", range(9)).check_hash_config(4, outside)


@pytest.mark.parametrize(
    "args,match",
    [((1, [1]), "request_id"), (("r", []), "empty"), (("r", [1, -2]), ">= 0")],
)
def test_request_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        Request(*args)


def test_tokens_may_be_numpy_integers_and_bad_tokens_append_nothing():
    req = Request("r", np.array([5, 6], np.int64))
    req.append_output_token_ids(np.int64(7))
    req.append_output_token_ids(np.array([8, 9], np.uint16))
    assert list(req.all_token_ids) == [5, 6, 7, 8, 9]
    assert all(type(t) is int for t in req.all_token_ids)
    for bad, match in ((-1, ">= 0, got -1"), ([10, -2], ">= 0, got -2"), (1.5, "ints >= 0")):
        with pytest.raises(ValueError, match=f"token_ids of 'r' must be {match}"):
            req.append_output_token_ids(bad)
    assert list(req.all_token_ids) == [5, 6, 7, 8, 9] and req.output_token_ids == [7, 8, 9]
    with pytest.raises(ValueError, match="prompt_token_ids of 'f' must be ints"):
        Request("f", [1, 2.5])


@pytest.mark.parametrize(
    "tokens", [[True, 2], [1, False], b"ab", bytearray(b"ab"), {1: 2}, {3, 1, 2}, frozenset([4])]
)
def test_bools_bytes_mappings_and_sets_are_not_token_ids(tokens):
    # True was read as token 1, bytes as their character codes, a dict as its keys and a
    # set in its own order.
    with pytest.raises(ValueError, match="prompt_token_ids of 'r' must be ints"):
        Request("r", tokens)
    req = Request("r", [5, 6])
    for bad in (True, [7, True], b"\x07", {7}, {7: 8}):
        with pytest.raises(ValueError, match="token_ids of 'r' must be ints"):
            req.append_output_token_ids(bad)
    assert list(req.all_token_ids) == [5, 6] and req.output_token_ids == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sampling_params": {"max_tokens": 3}}, "sampling_params="),
        ({"sampling_params": 3}, "sampling_params="),
        ({"arrival_time": float("nan")}, "arrival_time="),
        ({"arrival_time": "now"}, "arrival_time="),
        ({"arrival_time": True}, "arrival_time="),
        ({"arrival_time": 10**400}, "arrival_time="),  # used to raise OverflowError
    ],
)
def test_request_refuses_bad_params_and_arrival_time(kwargs, match):
    # A dict as sampling_params used to be stored and fail later as an AttributeError.
    with pytest.raises(ValueError, match=match):
        Request("r", [1, 2], **kwargs)


@pytest.mark.parametrize(
    "block_size,seed,match",
    [
        (0, 0, "block_size=0 must be an int >= 1"),  # ZeroDivisionError before
        (-4, 0, "block_size=-4"),  # returned [] and kept -4 as the request's block size
        ("4", 0, "block_size='4'"),  # TypeError before
        (4.0, 0, "block_size=4.0"),  # struct.error before
        (True, 0, "block_size=True"),
        (4, "1", "seed='1' must be an int that fits in 64 bits"),
        (4, 2**64, "seed=18446744073709551616"),
    ],
)
def test_bad_hash_arguments_are_refused_and_leave_the_request_hashable(block_size, seed, match):
    # Each used to record (block_size, seed) before failing (or returning []): every
    # later hashing of the request, a manager's included, was then refused.
    req = Request("r", range(9))
    with pytest.raises(ValueError, match=match):
        req.update_block_hashes(block_size, seed)
    with pytest.raises(ValueError, match=match):
        req.check_hash_config(block_size, seed)
    assert req.block_hashes == []
    assert req.update_block_hashes(4, 0) == Request("s", range(9)).update_block_hashes(4)
    assert req.update_block_hashes(np.int64(4), np.uint8(0)) == req.block_hashes  # same config


def test_arrival_time_defaults_to_the_monotonic_clock_and_keeps_a_given_one():
    before = time.monotonic()
    req = Request("r", [1])
    assert before <= req.arrival_time <= time.monotonic()
    assert Request("s", [1], arrival_time=12.5).arrival_time == 12.5


def test_a_misspelt_field_assignment_fails_instead_of_adding_an_attribute():
    req = Request("r", [1])
    with pytest.raises(AttributeError):
        req.num_computed_token = 1  # num_computed_tokens


def test_sampling_params_edge_values_are_taken_and_the_next_ones_refused():
    """Each range's closed ends are accepted; just past them is refused by name."""
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    tiny, f32_max = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    assert SamplingParams(repetition_penalty=tiny).repetition_penalty == tiny
    assert SamplingParams(repetition_penalty=f32_max).repetition_penalty == f32_max
    for value in (float(np.nextafter(np.float32(tiny), np.float32(0))), f32_max * 2):
        with pytest.raises(ValueError, match="^repetition_penalty="):
            SamplingParams(repetition_penalty=value)


def test_sampling_params_store_min_p_and_repetition_penalty_as_python_floats():
    p = SamplingParams(min_p=np.float32(0.5), repetition_penalty=np.float32(1.5))
    assert type(p.min_p) is float and type(p.repetition_penalty) is float
    assert type(SamplingParams(min_p=1, repetition_penalty=2).min_p) is float


@pytest.mark.parametrize(
    "kwargs",
    [
        {"frequency_penalty": 0.5},
        {"presence_penalty": -0.5},
        {"repetition_penalty": 0.5},
        {"repetition_penalty": 1.5},
    ],
)
def test_any_one_penalty_off_its_no_op_value_counts(kwargs):
    assert SamplingParams(**kwargs).has_penalties
    assert not SamplingParams().has_penalties


def test_stopping_at_appends_new_eos_ids_unless_ignore_eos():
    p = SamplingParams(stop_token_ids=(3, 5))
    assert p.stopping_at((5, 7, 3)).stop_token_ids == (3, 5, 7)
    assert p.stopping_at((5,)) == p
    ignoring = SamplingParams(stop_token_ids=(3,), ignore_eos=True)
    assert ignoring.stopping_at((7,)).stop_token_ids == (3,)


def test_stream_text_must_be_a_bool():
    with pytest.raises(ValueError, match="^stream_text='yes' must be a bool"):
        SamplingParams(stream_text="yes")


def test_a_request_starts_with_no_preemptions_and_refuses_an_empty_id():
    assert Request("r", [1]).num_preemptions == 0
    with pytest.raises(ValueError, match="request_id='' must be a non-empty str"):
        Request("", [1])


@pytest.mark.parametrize("tokens", [2**63, [2**63], [1, 2**63]])
def test_a_token_id_past_64_signed_bits_is_refused_and_appends_nothing(tokens):
    req = Request("r", [2**63 - 1])
    assert req.prompt_token_ids == (2**63 - 1,)
    with pytest.raises(ValueError, match=f"must be <= {2**63 - 1}"):
        req.append_output_token_ids(tokens)
    assert req.output_token_ids == [] and req.num_tokens == 1
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("s", [2**63])


def test_block_hashes_depend_on_the_hash_seed():
    a, b = Request("a", range(8)), Request("b", range(8))
    assert a.update_block_hashes(4, seed=7) != b.update_block_hashes(4, seed=0)
    assert a.block_hashes == Request("c", range(8)).update_block_hashes(4, seed=7)


def test_the_prompt_cannot_be_replaced_after_construction():
    # A replaced prompt used to be taken silently: num_prompt_tokens followed it, while the
    # tokens that are hashed, cached and computed stayed the old ones.
    m = KVCacheManager(8, 2, max_model_len=16)
    req = Request("r", [1, 2, 3, 4, 5])
    m.allocate_slots(req, 5)
    with pytest.raises(AttributeError, match="prompt_token_ids"):
        req.prompt_token_ids = (7, 8)
    assert req.prompt_token_ids == (1, 2, 3, 4, 5) == tuple(req.all_token_ids)
    assert req.num_prompt_tokens == 5
    m.check_integrity()


@pytest.mark.parametrize("field", ["adapter_id", "cache_salt"])
@pytest.mark.parametrize("value", ["b", 5])
def test_adapter_id_and_cache_salt_are_fixed_at_construction(field, value):
    """Both are hashed into block_hashes. Reassigned after a lookup, the hashes kept the
    old key, so a cache hit of adapter 'a' passed for a request now under another; an
    invalid one failed the hashing after allocate_slots had taken a block."""
    m = KVCacheManager(8, 2, max_model_len=16)
    cached = Request("c", [1, 2, 3, 4, 5], **{field: "a"})
    m.allocate_slots(cached, 5)
    req = Request("r", [1, 2, 3, 4, 5], **{field: "a"})
    assert m.get_computed_blocks(req) == (m.block_ids("c")[:2], 4)
    with pytest.raises(AttributeError, match=field):
        setattr(req, field, value)
    assert getattr(req, field) == "a"
    free = m.num_free_blocks
    with pytest.raises(AttributeError, match=field):
        setattr(cached, field, value)
    cached.num_computed_tokens = 5
    cached.append_output_token_ids([6, 7])
    assert m.allocate_slots(cached, 2) == [4]
    assert m.num_free_blocks == free - 1
    m.check_integrity()


def test_block_hashes_cannot_be_replaced():
    """The manager caches a request's blocks under its block_hashes. Another prompt's
    hashes assigned to them used to be taken: the request's KV was cached under that
    prompt, which then hit it, and check_integrity (which reads the same list) passed."""
    m = KVCacheManager(16, 4, max_model_len=64)
    req = Request("r", [1] * 12)
    with pytest.raises(AttributeError, match="block_hashes"):
        req.block_hashes = Request("x", [9] * 12).update_block_hashes(4)
    assert req.block_hashes == []
    m.allocate_slots(req, 12)
    assert req.block_hashes == Request("y", [1] * 12).update_block_hashes(4)
    assert m.get_computed_blocks(Request("v", [9] * 13)) == ([], 0)
    m.check_integrity()


def test_block_hashes_carry_the_adapter_on_every_block_and_the_salt_on_the_first():
    """A request hashes its adapter id as the adapter key and its cache salt as the salt
    key: its hashes equal extend_block_hashes given each in its place. The two keys enter
    the hashes differently (hashing's module doc), so swapping them gives other hashes,
    though every request would still hash apart from the others."""
    tokens = list(range(12))
    req = Request("r", tokens, adapter_id="lora", cache_salt="tenant")
    want = extend_block_hashes([], tokens, 4, seed=7, adapter_id="lora", cache_salt="tenant")
    assert req.update_block_hashes(4, 7) == want
    swapped = extend_block_hashes([], tokens, 4, seed=7, adapter_id="tenant", cache_salt="lora")
    assert want != swapped


@pytest.mark.parametrize("value", [SamplingParams(max_tokens=1, n=2), 5, None])
def test_sampling_params_are_fixed_at_construction(value):
    """The scheduler checks them (n, stop strings' tokenizer) when it takes the request,
    and registers their penalties and min_tokens then: replaced later, they used to be
    taken silently, an int or None included, and were read from then on beside that
    state built from the old ones."""
    params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    req = Request("r", [1, 2, 3], params)
    with pytest.raises(AttributeError, match="sampling_params"):
        req.sampling_params = value
    assert req.sampling_params is params and req.max_tokens == 4
    assert req.skips_prefix_cache_reads


@pytest.mark.parametrize("rid", ["a\ud800", "\udfff", "\ud83d\ude00"])  # the last: two halves
def test_an_id_holding_a_lone_surrogate_is_refused_as_a_cache_salt_is(rid):
    """Ids go into logs, JSON outputs and routers' maps, which cannot encode one."""
    with pytest.raises(ValueError, match="^request_id=.* must be a non-empty str encodable"):
        Request(rid, [1])
    for text in ("é", "日本", "\U0001f600"):
        assert Request(text, [1]).request_id == text


def test_all_token_ids_is_the_requests_own_list_that_grows_with_its_output():
    # It was called a read-only view; it is the live list (not copied per step).
    req = Request("r", [5, 6])
    tokens = req.all_token_ids
    req.append_output_token_ids([7, 8])
    assert tokens is req.all_token_ids and list(tokens) == [5, 6, 7, 8]
