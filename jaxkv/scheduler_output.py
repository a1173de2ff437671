"""What one schedule() call hands on (SchedulerOutput), how it is built, and counters."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.request import Request


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One step's batch, in schedule order (the planner may reorder it for attention).

    Hides the queues: everything the planner, the metadata builder and the engine need
    is here as parallel arrays. Safe to use until the next schedule() call.
    """

    requests: list[Request]  # scheduled requests, in schedule order
    request_ids: list[str]  # their ids, same order
    num_scheduled_tokens: np.ndarray  # i32[R] tokens computed this step per request
    num_computed_tokens: np.ndarray  # i32[R] tokens already in the cache before this step
    token_ids: list[int]  # the tokens computed this step, request by request, in order
    preempted_request_ids: tuple[str, ...]  # preempted by this schedule() call
    finished_request_ids: tuple[str, ...]  # left the scheduler since the previous call

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """Counters since the scheduler was built."""

    num_preemptions: int = 0
    # Prefill tokens run through the model, once per run: prompt chunks, and again the
    # whole context of a request recomputed after preemption, and again a chunk that an
    # update interrupted before reaching it, and a chunk of a request aborted between
    # schedule() and update_from_output() (prefix-cache hits are not computed).
    num_prompt_tokens_computed: int = 0
    # One per decode step of a request with output, a decode run again after an
    # interrupted update, or of a request aborted before its step's update, as well.
    num_decode_tokens_computed: int = 0
    num_generated_tokens: int = 0


@dataclasses.dataclass
class DecodeCarry:
    """What the next step needs of the running requests when each has one token left.

    Left by Scheduler.update_from_output when its output covered every running request
    and none is mid-prompt; the next schedule() then skips its pass over the requests.
    """

    num_computed: list[int]  # per running request, in order
    token_ids: list[int]  # the token each computes next
    needing: list[Request]  # those whose next token needs a new block or fills one to cache


class StepBatch:
    """The scheduled requests of one step as they are chosen (SchedulerOutput's fields).

    Either built request by request (add), or started from the running requests' arrays
    at once (set_running) and then added to.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Empties the batch."""
        self.requests: list[Request] = []
        self.token_ids: list[int] = []
        self._head_tokens = self._head_computed = _NO_INTS  # set_running's arrays
        self.num_tokens: list[int] = []  # of the requests added one by one
        self.num_computed: list[int] = []

    def set_running(
        self,
        requests: list[Request],
        num_tokens: np.ndarray,  # i32[R] tokens scheduled per request
        num_computed: np.ndarray,  # i32[R] tokens computed before this step
        token_ids: list[int],  # the scheduled tokens, request by request (taken over)
    ) -> None:
        """Starts an empty batch with `requests` and their arrays."""
        if self.requests:
            raise ValueError("set_running needs an empty batch")
        self.requests, self.token_ids = requests, token_ids
        self._head_tokens, self._head_computed = num_tokens, num_computed

    def add(self, request: Request, n: int) -> None:
        """Schedules `n` tokens of `request` after its computed ones."""
        computed = request.num_computed_tokens
        self.requests.append(request)
        self.num_tokens.append(n)
        self.num_computed.append(computed)
        self.token_ids.extend(request.all_token_ids[computed : computed + n])

    def output(
        self, preempted_request_ids: tuple[str, ...], finished_request_ids: tuple[str, ...]
    ) -> SchedulerOutput:
        num_tokens, num_computed = self._head_tokens, self._head_computed
        if self.num_tokens:
            num_tokens = np.concatenate([num_tokens, np.asarray(self.num_tokens, np.int32)])
            num_computed = np.concatenate([num_computed, np.asarray(self.num_computed, np.int32)])
        return SchedulerOutput(
            requests=self.requests,
            request_ids=[r.request_id for r in self.requests],
            num_scheduled_tokens=num_tokens,
            num_computed_tokens=num_computed,
            token_ids=self.token_ids,
            preempted_request_ids=preempted_request_ids,
            finished_request_ids=finished_request_ids,
        )


_NO_INTS = np.zeros(0, np.int32)
_NO_INTS.flags.writeable = False
