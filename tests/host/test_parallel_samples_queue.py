"""ParallelSamples.queue over a fake scheduler, and the default seeds of samples: what an
n > 1 request may not take, what a failed queue leaves, and seeds that stay apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxkv.parallel_sampling import ParallelSamples, child_default_seed
from jaxkv.request import Request, SamplingParams


class FakeScheduler:
    # What check_fits reads: room for any request of the tests.
    manager = SimpleNamespace(block_size=4, hash_seed=0, pool=SimpleNamespace(num_blocks=64))
    config = SimpleNamespace(max_model_len=64)
    detokenizer = None

    def __init__(self, fail_on: str | None = None) -> None:
        self.requests: dict[str, Request] = {}
        self.fail_on = fail_on

    def add_request(self, request: Request) -> None:
        if request.request_id == self.fail_on:
            raise KeyboardInterrupt  # interrupted midway: not a refusal checked up front
        self.requests[request.request_id] = request

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def forget_finished(self) -> None:
        pass  # keeps no finished ids


class FakeSampling:
    def __init__(self) -> None:
        self.seeds: dict[str, int] = {}

    def add_request(self, request: Request, default_seed: int) -> None:
        self.seeds[request.request_id] = default_seed

    def discard(self, request_id: str) -> None:
        self.seeds.pop(request_id, None)


def request(request_id: str, n: int) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(n=n, max_tokens=2))


def test_a_request_of_n_samples_may_not_take_the_id_of_a_running_request():
    scheduler, samples = FakeScheduler(), ParallelSamples()
    samples.queue(scheduler, FakeSampling(), request("x", 1), 0)
    with pytest.raises(ValueError, match="'x' is already in use"):
        samples.queue(scheduler, FakeSampling(), request("x", 2), 0)
    assert list(scheduler.requests) == ["x"] and "x" not in samples


def test_samples_queued_before_one_that_raised_are_aborted():
    scheduler, samples, sampling = FakeScheduler(fail_on="2_x"), ParallelSamples(), FakeSampling()
    with pytest.raises(KeyboardInterrupt):
        samples.queue(scheduler, sampling, request("x", 3), 0)
    assert scheduler.requests == {} and sampling.seeds == {} and "x" not in samples


def test_sample_default_seeds_differ_from_those_of_requests_queued_next():
    # Consecutive requests' default seeds differ by small offsets (their serials); their
    # samples must not draw with one another's seeds.
    seeds = {child_default_seed(seed, i) for seed in range(100, 108) for i in range(8)}
    assert len(seeds) == 64
    assert child_default_seed(100, 0) == 100


def test_samples_keep_the_adapter_salt_and_arrival_time_of_their_request():
    # The adapter id is a hash key of every block: a sample without it would neither hit
    # its request's cached blocks nor be kept apart from another adapter's.
    scheduler, samples = FakeScheduler(), ParallelSamples()
    parent = Request(
        "x",
        [1, 2, 3],
        SamplingParams(n=2, max_tokens=2),
        cache_salt="tenant",
        adapter_id="lora-7",
        arrival_time=12.5,
    )
    samples.queue(scheduler, FakeSampling(), parent, 0)
    kept = [(r.cache_salt, r.adapter_id, r.arrival_time) for r in scheduler.requests.values()]
    assert kept == [("tenant", "lora-7", 12.5)] * 2


def test_discard_says_true_only_when_a_parents_last_sample_goes():
    """discard's answer: False for an id that is no sample (a plain request's, one
    discarded already) and for a sample whose parent has others left; True for the last."""
    scheduler, samples = FakeScheduler(), ParallelSamples()
    samples.queue(scheduler, FakeSampling(), request("x", 2), 0)
    samples.queue(scheduler, FakeSampling(), request("y", 1), 0)
    answers = [samples.discard(rid) for rid in ("y", "1_x", "1_x", "0_x")]
    assert answers == [False, False, False, True]
    assert "x" not in samples and len(samples) == 0


def test_a_taken_id_is_named_as_the_callers_before_any_sample_id():
    """When the request's own id and a sample's are both in use, the refusal names the
    caller's id alone: the sample ids are the engine's, not the caller's."""
    scheduler, samples = FakeScheduler(), ParallelSamples()
    for rid in ("x", "0_x"):
        samples.queue(scheduler, FakeSampling(), request(rid, 1), 0)
    with pytest.raises(ValueError, match=r"^request id 'x' is already in use$"):
        samples.queue(scheduler, FakeSampling(), request("x", 2), 0)
    samples.queue(scheduler, FakeSampling(), request("1_y", 1), 0)
    with pytest.raises(ValueError, match=r"'y' is already in use \(its sample id '1_y' is\)$"):
        samples.queue(scheduler, FakeSampling(), request("y", 2), 0)
