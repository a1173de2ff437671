"""Fake replicas for PrefixAwareRouter tests: no engine, no jax.

A FakeReplica emits one token per step for every request it holds and finishes a request
after `max_tokens` tokens (2 without params); its token says which replica made it.
"""

from __future__ import annotations

from jaxkv import SamplingParams
from jaxkv.outputs import RequestOutput
from jaxkv.router import PrefixAwareRouter

BLOCK = 4


class FakeReplica:
    def __init__(self, index: int) -> None:
        self.index = index
        self.running: dict[str, list] = {}  # request_id -> [prompt, tokens left]
        self.prompts: dict[str, list[int]] = {}  # every request ever added
        self.salts: dict[str, str | None] = {}  # request_id -> cache_salt

    def add_request(self, prompt_token_ids, sampling_params=None, *, request_id, cache_salt=None):
        if len(prompt_token_ids) == 0:
            raise ValueError("empty prompt")
        params = sampling_params or SamplingParams(max_tokens=2)
        self.running[request_id] = [list(prompt_token_ids), params.max_tokens]
        self.prompts[request_id] = list(prompt_token_ids)
        self.salts[request_id] = cache_salt
        return request_id

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, entry in list(self.running.items()):
            entry[1] -= 1
            done = entry[1] == 0
            token = 1000 * self.index + len(entry[0])
            outputs.append(RequestOutput(rid, (token,), done, "length" if done else None))
            if done:
                del self.running[rid]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def abort(self, request_id: str) -> bool:
        return self.running.pop(request_id, None) is not None


def make_router(n: int = 4, **kwargs) -> tuple[PrefixAwareRouter, list[FakeReplica]]:
    replicas = [FakeReplica(i) for i in range(n)]
    return PrefixAwareRouter(replicas, block_size=BLOCK, **kwargs), replicas


def rand_tokens(rng, n: int) -> list[int]:
    return rng.integers(0, 500, n).tolist()


class OffloadingReplica(FakeReplica):
    """Keeps each finished request's blocks for `copy_steps` more steps (a KV copy)."""

    def __init__(self, index: int, copy_steps: int) -> None:
        super().__init__(index)
        self.copy_steps = copy_steps
        self.copies: list[int] = []  # steps left per copy in flight

    def step(self):
        self.copies = [n - 1 for n in self.copies if n > 1]
        outputs = super().step()
        self.copies += [self.copy_steps for o in outputs if o.finished]
        return outputs

    def has_pending_transfers(self) -> bool:
        return bool(self.copies)
