"""Random walks through the manager's life, checked after every step.

Requests are added, prefilled in chunks (with cache hits), decoded (with lookahead),
finished and freed, finished and held (KV still copying out) then released, preempted and
re-run, and sometimes freed twice. After every step the pool's conservation laws hold,
every request holds exactly the blocks the test saw it receive, and
num_common_prefix_blocks of a random scheduled subset equals a brute-force column compare
of the block table rows of that subset, whatever other requests hold.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxkv import KVCacheManager, Request, RequestStatus, UnknownRequestError
from tests.host._util import snapshot

NUM_BLOCKS = 28
BLOCK_SIZE = 2
MAX_MODEL_LEN = 24
# Three long base prompts; requests take a prefix of one and add a few tokens from a small
# alphabet, so cache hits, partial sharing and duplicate blocks are all common.
BASES = [[100 + 10 * b + i % 7 for i in range(MAX_MODEL_LEN)] for b in range(3)]


# Weighted by repetition: allocation-heavy, like a serving loop.
_ACTIONS = (
    ["add"] * 2
    + ["prefill_chunk"] * 5
    + ["decode"] * 5
    + ["finish_and_hold", "release_held", "finish_and_free", "preempt"]
    + ["free_unknown", "reset_prefix_cache"]
    + ["scheduled_subset"] * 2
)


def _lcp_oracle(rows: list[list[int]]) -> int:
    """Leading columns in which every row holds the same block id (plain loop)."""
    if not rows:
        return 0
    k = 0
    while all(k < len(r) for r in rows) and all(r[k] == rows[0][k] for r in rows):
        k += 1
    return k


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
        self.waiting: dict[str, Request] = {}  # holds no blocks
        self.running: dict[str, Request] = {}  # holds blocks, may compute more
        self.held: dict[str, Request] = {}  # finished, blocks kept until the KV copy lands
        self.expected: dict[str, list[int]] = {}  # request id -> blocks the test saw it get
        self.freed: list[str] = []
        self.next_id = 0

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def step(self, data):
        """One engine-like action, drawn with weights; impossible ones fall back to prefill/add."""
        action = data.draw(st.sampled_from(_ACTIONS), label="action")
        if action == "prefill_chunk" and self._unfinished_work():
            self._prefill_chunk(data)
        elif action == "decode" and self._decodable():
            self._decode(data)
        elif action == "finish_and_hold" and self.running:
            req = self.running.pop(self._pick(data, self.running))
            req.status = RequestStatus.FINISHED_TRANSFERRING
            self.held[req.request_id] = req
        elif action == "release_held" and self.held:
            self._free(self.held.pop(self._pick(data, self.held)))
        elif action == "finish_and_free" and self.running:
            req = self.running.pop(self._pick(data, self.running))
            req.status = RequestStatus.FINISHED_STOPPED
            self._free(req)
        elif action == "preempt" and self.running:
            req = self.running.pop(self._pick(data, self.running))
            self._free(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            self.waiting[req.request_id] = req
        elif action == "free_unknown" and self.freed:
            self._free_unknown(data)
        elif action == "reset_prefix_cache":
            was_idle = not self.expected
            assert self.m.reset_prefix_cache() is was_idle
            if was_idle:
                assert not self.m.pool.cached_block_hash_to_block
        elif action == "scheduled_subset" and self.expected:
            # Half the time only holders of one first block, so shared prefixes are common.
            holders = sorted(self.expected)
            first = self.expected[data.draw(st.sampled_from(holders))][:1]
            if data.draw(st.booleans()):
                holders = [r for r in holders if self.expected[r][:1] == first]
            ids = data.draw(st.lists(st.sampled_from(holders), min_size=1, max_size=8, unique=True))
            self._check_prefix(ids)
        elif self._unfinished_work():
            self._prefill_chunk(data)
        else:
            self._add(data)

    def _add(self, data):
        base = data.draw(st.integers(0, 1))
        keep = data.draw(st.sampled_from([0, 3, 4, 6, 8, 8, 9, 12, 12, 16]))
        suffix = data.draw(st.lists(st.integers(0, 3), max_size=5))
        salt = data.draw(st.sampled_from([None, None, None, "s"]))
        tokens = (BASES[base][:keep] + suffix) or [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.waiting[rid] = Request(rid, tokens, cache_salt=salt)

    def _prefill_chunk(self, data):
        req = data.draw(st.sampled_from(self._unfinished_work()))
        rid = req.request_id
        hit_ids, num_hit = [], 0
        if rid in self.waiting:
            hit_ids, num_hit = self.m.get_computed_blocks(req)
            assert num_hit == len(hit_ids) * BLOCK_SIZE < req.num_tokens
        remaining = req.num_tokens - req.num_computed_tokens - num_hit
        chunk = data.draw(st.sampled_from([remaining, remaining, 1, 2, 3]))
        chunk = min(chunk, remaining)
        self._allocate(req, chunk, hit_ids, num_hit, 0)

    def _decode(self, data):
        req = data.draw(st.sampled_from(self._decodable()))
        req.append_output_token_ids([data.draw(st.integers(0, 3))])
        lookahead = min(data.draw(st.integers(0, 3)), MAX_MODEL_LEN - req.num_tokens)
        self._allocate(req, 1, [], 0, lookahead)

    def _free_unknown(self, data):
        rid = data.draw(st.sampled_from([*self.freed, "nobody"]))
        if rid in self.expected:  # freed earlier, allocated again since
            return
        before = snapshot(self.m)
        try:
            self.m.free(rid)
        except UnknownRequestError:
            pass
        else:
            raise AssertionError(f"free({rid!r}) of a request without blocks did not raise")
        assert snapshot(self.m) == before

    # ------------------------------------------------------------- invariants

    @invariant()
    def integrity(self):
        self.m.check_integrity()
        held = set()
        for rid, blocks in self.expected.items():
            assert self.m.block_ids(rid) == blocks
            held.update(blocks)
        assert self.m.num_free_blocks == NUM_BLOCKS - 1 - len(held)

    @invariant()
    def running_set_prefix(self):
        self._check_prefix(sorted(set(self.running) & set(self.expected)))

    # ---------------------------------------------------------------- helpers

    @staticmethod
    def _pick(data, reqs: dict[str, Request]) -> str:
        return data.draw(st.sampled_from(sorted(reqs)))

    def _unfinished_work(self) -> list[Request]:
        reqs = [*self.waiting.values(), *self.running.values()]
        return [r for r in reqs if r.num_computed_tokens < r.num_tokens]

    def _decodable(self) -> list[Request]:
        return [
            r
            for r in self.running.values()
            if r.num_computed_tokens == r.num_tokens < MAX_MODEL_LEN
        ]

    def _allocate(self, req, num_new, hit_ids, num_hit, lookahead):
        rid = req.request_id
        before = snapshot(self.m)
        queue = [b for b in before["free_queue"] if b not in hit_ids]
        new_ids = self.m.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_ids,
            num_lookahead_tokens=lookahead,
        )
        if new_ids is None:
            assert snapshot(self.m) == before
            return
        assert new_ids == queue[: len(new_ids)]  # taken from the head of the free queue
        self.expected.setdefault(rid, []).extend(hit_ids + new_ids)
        total = req.num_computed_tokens + num_hit + num_new + lookahead
        assert len(self.expected[rid]) == max(
            -(-total // BLOCK_SIZE), len(before["holders"].get(rid, []))
        )
        req.num_computed_tokens += num_hit + num_new
        req.status = RequestStatus.RUNNING
        self.waiting.pop(rid, None)
        self.running[rid] = req

    def _free(self, req):
        self.m.free(req)
        del self.expected[req.request_id]
        self.freed.append(req.request_id)

    def _check_prefix(self, ids):
        table = self.m.block_table
        rows = [table[row].tolist() for row in self.m.rows_of(ids)]
        rows = [r[: len(self.expected[rid])] for r, rid in zip(rows, ids, strict=True)]
        assert rows == [self.expected[rid] for rid in ids]
        assert self.m.num_common_prefix_blocks(ids) == _lcp_oracle(rows)


ManagerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("JAXKV_STATEFUL_EXAMPLES", "60")),
    stateful_step_count=60,
    deadline=None,
    derandomize="JAXKV_STATEFUL_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerStateful = ManagerMachine.TestCase
