"""Request ids given as str subclasses are taken as the exact str they hold.

A subclass hashing apart from its text let a second request be queued under an id in
use (both ran, each reported as that id) and missed the request in every lookup; one
without a hash raised TypeError "unhashable type" naming no argument.
"""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager, Request, Scheduler, SchedulerConfig
from jaxkv.request_id_lists import checked_request_ids


class OwnHash(str):
    def __hash__(self) -> int:
        return 12345  # not hash(str(self)): equal to its text, hashed apart from it


class NoHash(str):
    __hash__ = None


class OddAscii(str):
    def isascii(self) -> bool:
        return True


@pytest.mark.parametrize("kind", [OwnHash, NoHash])
def test_request_and_abort_lists_hold_the_exact_str(kind):
    request = Request(kind("r"), [1, 2, 3])
    assert type(request.request_id) is str and request.request_id == "r"
    ids = checked_request_ids([kind("a"), "b"])
    assert ids == ["a", "b"] and {type(rid) for rid in ids} == {str}
    assert type(checked_request_ids(kind("a"))[0]) is str


def test_an_id_whose_own_isascii_lies_is_still_refused():
    with pytest.raises(ValueError, match="request_id=.* must be a non-empty str encodable"):
        Request(OddAscii("a\ud800"), [1])


@pytest.mark.parametrize("kind", [OwnHash, NoHash])
def test_the_manager_finds_a_request_by_a_subclass_of_its_id(kind):
    manager = KVCacheManager(16, 4, max_model_len=32)
    request = Request(kind("r"), list(range(6)))
    assert manager.allocate_slots(request, 6) is not None
    assert manager.holds_row(kind("r")) and manager.holds_row("r")
    assert manager.block_ids(kind("r")) == manager.block_ids("r") == [1, 2]
    manager.uncache_unwritten(kind("r"), 6)
    manager.free(kind("r"))
    assert not manager.holds_row("r") and manager.num_free_blocks == 15
    manager.check_integrity()


@pytest.mark.parametrize("kind", [OwnHash, NoHash])
def test_the_scheduler_refuses_an_id_in_use_and_aborts_by_a_subclass(kind):
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32)
    scheduler = Scheduler(config, KVCacheManager(16, 4, max_model_len=32))
    scheduler.add_request(Request(kind("r"), [1, 2, 3]))
    with pytest.raises(ValueError, match="'r'"):
        scheduler.add_request(Request("r", [4, 5, 6]))
    assert list(scheduler.requests) == ["r"] and len(scheduler.waiting) == 1
    assert scheduler.abort(kind("r"))
    assert not scheduler.has_unfinished_requests()
