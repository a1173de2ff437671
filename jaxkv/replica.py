"""What PrefixAwareRouter needs of a replica (the `Replica` protocol), apart from the
router so that replicas other than jaxkv.engine.Engine can be written against it alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from jaxkv.outputs import RequestOutput

__all__ = ["Replica", "check_one_model"]


class Replica(Protocol):
    """What the router needs of a replica; jaxkv.engine.Engine has it. It also uses Engine's
    ids_in_use, has_pending_transfers, queue_checkpoint, reset_prefix_cache and
    close(timeout_s=...) where a replica has them (PrefixAwareRouter.close closes each
    replica that has close, as close(timeout_s=..., force=True) when forced, refusing one
    whose close takes no force then; PrefixAwareRouter.queue_checkpoint calls the check()
    of each replica's rewind that has one before it rewinds any). A has_pending_transfers,
    queue_checkpoint, reset_prefix_cache or close attribute that is not callable is
    refused where it is read, with ValueError naming it (None counts as no method);
    close and reset_prefix_cache read every replica's before they change anything.
    A `closed` attribute (Engine's property) that is True marks a replica closed: the
    router routes it no request and no longer steps it, aborts, resets or checkpoints on
    it (its requests there end at the router's next step); one without it, or None, is
    open, and one that is no bool is refused with ValueError naming it. Replicas with a
    `model_config` attribute (Engine's) must have equal ones (check_one_model).

    The router checks each answer where it reads it (jaxkv.replica_checks), raising
    ValueError that names the replica (its index and type), the method and the answer.
    step() must return a list (or tuple) of RequestOutput, each of a sequence (request
    id, sample index: a str and an int, no bool) the router sent the replica and that
    has not ended: none twice, none after the output that finished its request, a
    finished one with its finish_reason, a finish_reason without finished only on a
    sample's output (SamplingParams.n > 1). The outputs that pass are kept for the
    router's next step(), with those of the replicas stepped before it, and the rest
    dropped. Outputs of requests the router does not hold (added to the replica
    directly, or released after their finish) are dropped without an error.
    add_request must return the id it was asked to queue; when it raises, or returns
    another, the router aborts that id on the replica before the error propagates (it
    may have been queued), and the other id returned too, if a str that is not the id
    of one of the router's requests, or running samples, there (it may have been queued
    under it).
    has_unfinished_requests, has_pending_transfers and reset_prefix_cache must return
    bools (reset_prefix_cache's is checked once every replica has been asked), ids_in_use
    be a container, queue_checkpoint a function (the rewind). abort is called after the
    replica acted: an answer other than a bool is read by its truth, with a logged
    warning naming it.
    """

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Any = None,
        *,
        request_id: str,
        cache_salt: str | None = None,
    ) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def abort(self, request_id: str) -> bool: ...


def check_one_model(replicas: Sequence[Any]) -> None:
    """ValueError naming `replicas` when two of them serve different model configs, as
    their `model_config` attributes (Engine's LlamaConfig) say; a replica without one, or
    None, is not compared. A request's tokens would otherwise depend on the replica it is
    routed to, and a prefix route would send a prompt to KV another model computed.
    Weights are not compared (that reads every weight): engine_replicas places one
    model's weights on every replica."""
    first: tuple[int, Any] | None = None
    for i, replica in enumerate(replicas):
        config = getattr(replica, "model_config", None)
        if config is None:
            continue
        if first is None:
            first = (i, config)
            continue
        j, other = first
        if not _equal(config, other):
            raise ValueError(
                f"replicas: replica {i} serves another model than replica {j} "
                f"(model_config {_difference(other, config)}); a router's replicas must "
                "serve one model"
            )


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an answer with no truth (an array), or an __eq__ that raises
        return False


def _difference(a: Any, b: Any) -> str:
    """The fields in which dataclasses `a` and `b` of one type differ, else both types."""
    if type(a) is type(b) and dataclasses.is_dataclass(a):
        fields = dataclasses.fields(a)
        names = [f.name for f in fields if not _equal(getattr(a, f.name), getattr(b, f.name))]
        if names:
            return "differs in " + ", ".join(names)
    return f"{type(a).__name__} != {type(b).__name__}"
