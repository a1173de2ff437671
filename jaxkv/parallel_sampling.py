"""SamplingParams.n > 1: one prompt, n samples, each served as a request of its own.

As vLLM's ParentRequest: the engine queues sample i of request `rid` as the request
`f"{i}_{rid}"` (child_request_ids) with n = 1 and, under a seed, seed + i (child_params).
The samples share the prompt's KV through the prefix cache (its full blocks are cached
once the first sample is allocated, in the same step), and so the cascade levels over it.

ParallelSamples keeps the live parents. Its `relabel` turns a step's outputs of samples
into outputs of their parent: `request_id` the parent's, `index` the sample's,
`finish_reason` the sample's own, and `finished` True only on the output after which no
sample of the parent runs, as vLLM's RequestOutput.finished.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from typing import TYPE_CHECKING

from jaxkv.request import Request
from jaxkv.request_id_lists import plain_id
from jaxkv.sampling_params import SamplingParams
from jaxkv.scheduler_admission import check_fits

if TYPE_CHECKING:
    from jaxkv.sampler import SamplingRows
    from jaxkv.scheduler import Scheduler

_SEED_MASK = (1 << 64) - 1
# Unseeded samples of one request draw with default_seed + i * _CHILD_SEED_STEP: an odd
# 64-bit step, so the n seeds of a request differ, and far from the small offsets between
# the default seeds of consecutive requests (their serials).
_CHILD_SEED_STEP = 0xD1B54A32D192ED03


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n samples, as vLLM names them: "0_<id>" to "<n-1>_<id>"."""
    return [f"{i}_{request_id}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s params: n = 1 and, under a seed, seed + index (modulo 2**64).
    Only sample 0 computes prompt logprobs: the others read its cached prompt KV."""
    seed = None if params.seed is None else (params.seed + index) & _SEED_MASK
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def child_default_seed(default_seed: int, index: int) -> int:
    """The default (unseeded) sampling seed of sample `index` of a request whose own
    default seed is `default_seed`; sample 0 keeps it."""
    return (default_seed + index * _CHILD_SEED_STEP) & _SEED_MASK


class IdsInUse:
    """The ids a new request of `n` samples may not take: an id is in use when it, or
    under n > 1 one of its samples' ids, is in one of `holders` (a scheduler's requests,
    a ParallelSamples' parents, a router's requests)."""

    def __init__(self, *holders: Container[str], n: int = 1) -> None:
        self._holders, self._n = holders, n

    def __contains__(self, request_id: object) -> bool:
        if isinstance(request_id, str):
            request_id = plain_id(request_id)
        if any(request_id in holder for holder in self._holders):
            return True
        if self._n == 1 or not isinstance(request_id, str):
            return False
        ids = child_request_ids(request_id, self._n)
        return any(rid in holder for rid in ids for holder in self._holders)


class ParallelSamples:
    """The live requests of n > 1 and their samples' request ids."""

    def __init__(self) -> None:
        self._live: dict[str, set[str]] = {}  # parent id -> ids of its unfinished samples
        self._parent_of: dict[str, tuple[str, int]] = {}  # sample id -> (parent id, index)

    def __contains__(self, request_id: object) -> bool:
        """True for the id of a parent with a sample still running."""
        return isinstance(request_id, str) and request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def queue(
        self,
        scheduler: Scheduler,
        sampling: SamplingRows,
        request: Request,
        default_seed: int,
    ) -> None:
        """Queues `request` (checked, new) on `scheduler` and its sampling row, or under
        n > 1 its n samples (the request itself never runs): all of them or, raising
        ValueError when an id is in use or the scheduler cannot serve them (the error
        names the request's id, never a sample's) or propagating an interrupt, none.
        Samples keep the request's prompt, cache salt, adapter id and arrival time (so
        they share its cached blocks and its place in the queue)."""
        params = request.sampling_params
        n = params.n
        in_use = IdsInUse(scheduler.requests, self)
        if n == 1:
            if request.request_id in in_use:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._queue_all(scheduler, sampling, [request], [default_seed])
            return
        ids = child_request_ids(request.request_id, n)
        taken = [rid for rid in (request.request_id, *ids) if rid in in_use]
        if taken:  # named by the caller's id: a sample's is the engine's own
            held = "" if taken[0] == request.request_id else f" (its sample id {taken[0]!r} is)"
            raise ValueError(f"request id {request.request_id!r} is already in use{held}")
        samples = [
            Request(
                rid,
                request.prompt_token_ids,
                child_params(params, i),
                cache_salt=request.cache_salt,
                adapter_id=request.adapter_id,
                arrival_time=request.arrival_time,
            )
            for i, rid in enumerate(ids)
        ]
        check_fits(scheduler, samples[0], request.request_id)  # as sample 0's add would
        # The first raises where any would (all alike but their ids, checked above).
        seeds = [child_default_seed(default_seed, i) for i in range(n)]
        self._queue_all(scheduler, sampling, samples, seeds)
        self._live[request.request_id] = set(ids)
        for i, rid in enumerate(ids):
            self._parent_of[rid] = (request.request_id, i)

    def ids_to_abort(self, request_id: str) -> list[str]:
        """[request_id], or for a live parent its unfinished samples in index order. Each
        stays known until discarded, so an abort interrupted midway can be repeated."""
        if request_id not in self:
            return [request_id]
        return sorted(self._live[request_id], key=lambda s: self._parent_of[s][1])

    def abort(self, scheduler: Scheduler, sampling: SamplingRows, request_id: str) -> bool:
        """scheduler.abort(request_id) (True if it aborted the request); then, once the
        request has ended, its sampling row, its place among the samples and the finished
        ids the scheduler keeps for its next output are forgotten, after an interrupt too
        (Scheduler.abort raises one once the request is released: the row used to stay
        behind for good)."""
        try:
            return scheduler.abort(request_id)
        finally:
            request = scheduler.requests.get(request_id)
            if request is None or request.is_finished():  # else cut before: abort again
                sampling.discard(request_id)
                self.discard(request_id)
                # The engine reads no finished ids, and an idle one is not scheduled until
                # a request comes: it kept the id of each request aborted meanwhile.
                scheduler.forget_finished()

    def _queue_all(
        self,
        scheduler: Scheduler,
        sampling: SamplingRows,
        requests: list[Request],
        seeds: list[int],
    ) -> None:
        """Queues each of `requests` on `scheduler` with its sampling row (default seed from
        `seeds`): all or, whatever raises (a refusal, an interrupt), none (each queued one
        aborted as abort() does, its row forgotten). A request queued without its row
        failed every later step (KeyError), unknown to the caller: the add_request that
        queued it never returned its id."""
        try:
            for request, seed in zip(requests, seeds, strict=True):
                scheduler.add_request(request)
                sampling.add_request(request, seed)
        except BaseException:
            for request in requests:  # only those this call queued (another may hold an id)
                if scheduler.requests.get(request.request_id) is request:
                    self.abort(scheduler, sampling, request.request_id)
            raise

    def discard(self, sample_id: str) -> bool:
        """Forgets a sample that ended, and its parent once it has no sample left; returns
        True when that happened (False too for an id that is no sample). A parent whose
        last sample was aborted gets no output saying it finished, as an aborted request."""
        parent = self._parent_of.pop(sample_id, None)
        if parent is None:
            return False
        live = self._live[parent[0]]
        live.discard(sample_id)
        if live:
            return False
        del self._live[parent[0]]
        return True

    def discard_finished(self, requests: list) -> None:
        """Forgets the finished ones of `requests` (a step's batch whose outputs were lost
        to an exception: relabel forgets them otherwise)."""
        for request in requests:
            if request.request_id in self._parent_of and request.is_finished():
                self.discard(request.request_id)

    def relabel(self, outputs: list) -> list:
        """`outputs` (RequestOutputs of one step, in order) with each sample's output made
        its parent's; the parent's last one (no sample left running) says finished."""
        parent_of = self._parent_of
        for j, output in enumerate(outputs):
            parent = parent_of.get(output.request_id)
            if parent is None:
                continue
            request_id, index = parent
            finished = output.finished and self.discard(output.request_id)
            outputs[j] = output._replace(request_id=request_id, finished=finished, index=index)
        return outputs
