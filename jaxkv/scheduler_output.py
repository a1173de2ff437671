"""What one schedule() call hands on (SchedulerOutput) and the scheduler's counters."""

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
    num_prompt_tokens_computed: int = 0  # prefill tokens run through the model
    num_decode_tokens_computed: int = 0
    num_generated_tokens: int = 0


@dataclasses.dataclass
class StepBatch:
    """The scheduled requests of one step as they are chosen (SchedulerOutput's lists)."""

    requests: list[Request] = dataclasses.field(default_factory=list)
    num_tokens: list[int] = dataclasses.field(default_factory=list)
    num_computed: list[int] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)

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
        return SchedulerOutput(
            requests=self.requests,
            request_ids=[r.request_id for r in self.requests],
            num_scheduled_tokens=np.asarray(self.num_tokens, np.int32),
            num_computed_tokens=np.asarray(self.num_computed, np.int32),
            token_ids=self.token_ids,
            preempted_request_ids=preempted_request_ids,
            finished_request_ids=finished_request_ids,
        )
