"""How the router's requests end (jaxkv.router): released, their ids free and their
replica's count down, once their finishing output is returned, when aborted, or when
their replica ended them unreported (it failed with none left, or it was closed)."""

from __future__ import annotations

from jaxkv.hashing import BlockHash
from jaxkv.outputs import RequestOutput
from jaxkv.replica_checks import CheckedReplicas
from jaxkv.router_samples import RunningSamples


class RequestEnds:
    """PrefixAwareRouter's base (with RoutingRule): its bookkeeping of ending requests,
    over the router's state below (see its __init__)."""

    _replica_of: dict[str, int]  # request_id -> replica, while unfinished
    _queued: dict[str, list[BlockHash]]  # request_id -> its prompt's prefix keys
    _samples: RunningSamples  # of requests of n > 1
    _checked: CheckedReplicas
    _outstanding: list[int]  # replica -> unfinished sequences
    _undelivered: list[RequestOutput]  # gathered by a step() that raised

    def _release(self, owner: str, sample: tuple[str, int] | None, aborted: bool) -> None:
        """Releases request `owner`'s sequences (`sample`'s alone if given), those that
        are not `aborted` and have a finishing output to deliver excepted."""
        running = [sample] if sample else [(owner, i) for i in self._samples.running(owner)]
        for key in running or [(owner, 0)]:  # its sequences: (request id, sample index)
            if not aborted and any(
                (o.request_id, o.index) == key and o.finish_reason is not None
                for o in self._undelivered
            ):
                continue  # that output ends it when step() delivers it
            self._undelivered = [o for o in self._undelivered if (o.request_id, o.index) != key]
            if running:
                self._sample_ended(*key)
            else:
                self._finish(owner)

    def _finish(self, request_id: str) -> None:
        replica = self._replica_of.pop(request_id, None)
        self._queued.pop(request_id, None)
        if replica is not None:
            self._checked.end(replica, request_id, self._samples.running(request_id) or [0])
            self._outstanding[replica] -= self._samples.pop(request_id)
            if self._undelivered:  # released meanwhile (drain_transfers): they go with it
                self._undelivered = [o for o in self._undelivered if o.request_id != request_id]

    def _sample_ended(self, parent: str, index: int) -> None:
        """One sample ended: one sequence fewer; the request ends with its last sample
        (an aborted last sample gets no output saying so)."""
        if self._samples.end(parent, index):
            replica = self._replica_of[parent]
            self._checked.end(replica, parent, [index])
            self._outstanding[replica] -= 1
            if not self._samples.num_running(parent):
                self._finish(parent)

    def _release_if_idle(self, index: int, error: BaseException) -> None:
        """After replicas[index] raised in step(): if it has no unfinished request, the
        router's requests there ended in that step, their outputs lost, and are released
        as abort() would (those with a finishing output kept excepted). Its answer that
        raises or is no bool is noted on `error`, nothing released."""
        try:
            idle = not self._checked.unfinished(index)
        except Exception as failure:  # noqa: BLE001 - the step's error is the one raised
            error.add_note(f"releasing its ended requests, {failure!r} was raised")
            return
        if idle:
            self._release_on({index})

    def _release_on(self, replicas: set[int]) -> None:
        """Releases the router's requests on `replicas` as abort() would, those with a
        finishing output kept excepted: they ended there (a closed or failed replica)."""
        if replicas:
            for request_id in [r for r, i in self._replica_of.items() if i in replicas]:
                self._release(request_id, None, aborted=False)

    def _finished_from(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        samples = self._samples
        for o in outputs:
            if o.finish_reason is not None and samples.is_parent(o.request_id):
                self._sample_ended(o.request_id, o.index)
            if o.finished:
                self._finish(o.request_id)
        return outputs
