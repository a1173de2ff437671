"""Random walks through HostOffloadConnector's saves and loads, landing in any order and
failing at random, checked after every step.

Prompts are chains of blocks drawn from a small tree, so saves and loads of different
requests share heads and extend each other's chains. After every step: the store stays
within its byte budget, its parent links are consistent, every stored block comes before
its stored parent in eviction order (a tail never outlives its head), and every stored
block is claimable by on_admission behind device-cache hits up to its nearest ancestor
missing from the store.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier, store_link_faults

BS = 2
HOST_BLOCKS = 5
# Block i of a prompt is (10 * i + variant, 10 * i + variant): two variants per depth.
prompts = st.lists(st.integers(0, 1), min_size=1, max_size=4).map(
    lambda variants: [t for i, v in enumerate(variants) for t in (10 * i + v,) * BS]
)


class HostStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.copier = FakeCopier(32, BS, auto_complete=False)
        self.conn = HostOffloadConnector(HOST_BLOCKS * self.copier.bytes_per_block)
        self.conn.bind(self.copier, block_size=BS, hash_seed=0)
        self.prompt_of: dict[bytes, list[int]] = {}  # stored hash -> prompt ending with it
        self.next_id = 0

    def _request(self, tokens: list[int], num_computed: int) -> Request:
        self.next_id += 1
        req = Request(f"r{self.next_id}", [*tokens, 1], SamplingParams())
        req.num_computed_tokens = num_computed
        return req

    @rule(tokens=prompts, fail=st.booleans())
    def finish(self, tokens, fail):
        req = self._request(tokens, len(tokens))
        hashes = req.update_block_hashes(BS, 0)
        for i, h in enumerate(hashes):
            self.prompt_of[h] = tokens[: (i + 1) * BS]
        self.copier.fail_saves = fail
        self.conn.on_finish(req, list(range(1, len(tokens) // BS + 1)))

    @rule(tokens=prompts, fail=st.booleans())
    def load(self, tokens, fail):
        req = self._request(tokens, 0)
        claimed = self.conn.on_admission(req, 0)
        if claimed:
            self.copier.fail_loads = fail
            self.conn.start_load(req, list(range(1, claimed // BS + 1)))

    @rule(data=st.data())
    def land_one(self, data):
        if self.copier.pending:
            i = data.draw(st.integers(0, len(self.copier.pending) - 1))
            self.copier._run(*self.copier.pending.pop(i))

    @rule()
    def poll(self):
        self.conn.poll()

    @invariant()
    def stored_chains_stay_loadable_and_tails_go_first(self):
        store = self.conn._store
        assert len(store) <= HOST_BLOCKS and not store_link_faults(self.conn)
        position = {h: i for i, h in enumerate(store)}
        for h in store:
            parent = store.parent_of(h)
            assert parent not in position or position[h] < position[parent]
            # Loadable behind device hits up to its nearest ancestor missing here.
            tokens = self.prompt_of[h]
            probe = Request("probe", [*tokens, 1], SamplingParams())
            hashes = probe.update_block_hashes(BS, 0)
            depth = len(hashes) - 1
            gap = max((j for j in range(depth) if hashes[j] not in store), default=-1)
            assert self.conn.on_admission(probe, (gap + 1) * BS) == (depth - gap) * BS


HostStoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("JAXKV_STATEFUL_EXAMPLES", "60")),
    stateful_step_count=50,
    deadline=None,
    derandomize="JAXKV_STATEFUL_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHostStoreStateful = HostStoreMachine.TestCase
