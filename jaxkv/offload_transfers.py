"""HostOffloadConnector's copies in flight: what each one is, and how its landed Future is
read (jaxkv.host_offload_connector)."""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Callable
from concurrent.futures import Future

from jaxkv.field_checks import is_bool
from jaxkv.hashing import BlockHash
from jaxkv.held_interrupts import UserCode


@dataclasses.dataclass
class Transfer:
    request_id: str
    future: Future
    hashes: list[BlockHash]
    start_step: int
    num_tokens: int = 0  # loads: prompt tokens the loaded blocks cover
    serials: list[int] = dataclasses.field(default_factory=list)  # loads: store entries read
    chain: list[BlockHash] = dataclasses.field(default_factory=list)  # saves: all full blocks


def collect(
    transfers: dict[str, Transfer], finish: Callable[[Transfer], bool], step: int, delay: int
) -> tuple[list[str], list[str]]:
    """Takes out of `transfers` each one landed and started at least `delay` polls before
    poll `step`, and ends it with `finish`: (the ids it returned True for, the others)."""
    ok, failed = [], []
    for req_id, t in list(transfers.items()):
        if step - t.start_step < delay or not t.future.done():
            continue
        del transfers[req_id]
        (ok if finish(t) else failed).append(req_id)
    return ok, failed


def copy_result(future: Future):
    """The landed copy's result. A copy that ended with a BaseException of its own (a
    KeyboardInterrupt or SystemExit raised in its thread, which the Future stores) failed
    like any other: raised as it is, it would escape poll() with its transfer already
    dropped, and the request would hold its blocks for good."""
    error = future.exception()  # the copy is done: this never waits
    if error is not None and not isinstance(error, Exception):
        raise RuntimeError(f"the copy ended with {error!r}") from error
    return future.result()


def started(copier: object, method: str, user_code: UserCode, *args) -> Future:
    """The copy that `copier`'s `method` starts with `args`, its Future checked
    (checked_future). `user_code` is set just around the call: the copier is the
    connector's user code, which a holding scheduler lets a Ctrl-C stop at once, while
    the connector's bookkeeping before and after it is held, done whole."""
    call = getattr(copier, method)
    user_code.runs = True
    try:
        answer = call(*args)
    finally:
        user_code.runs = False
    return checked_future(copier, method, answer)


def check_not_in_flight(hook: str, req_id: str, transfers: dict[str, Transfer]) -> None:
    """ValueError while a copy of `req_id` is in `transfers`: a second one would
    replace its record, its hashes marked as being saved for good, its end unreported."""
    if req_id in transfers:
        raise ValueError(f"{hook}({req_id!r}): a copy of that request is in flight")


def is_closed(copier: object) -> bool:
    """Whether `copier.closed` is True (a bool, numpy's too): its copy thread is stopped.
    Read by its truth, a `closed` method or the text "no" passed for a closed copier, and
    unbind forgot the copies still in flight from a copier that was open."""
    closed = getattr(copier, "closed", False)
    return is_bool(closed) and bool(closed)


def checked_future(copier: object, method: str, answer: object) -> Future:
    """`answer`, what `copier`'s `method` returned, if a concurrent.futures.Future; else
    ValueError naming them: poll() reads every transfer's Future at each call, so one
    that is none would fail each later poll() and hold the request's blocks for good."""
    if not isinstance(answer, Future):
        shown = _repr.repr(answer)
        raise ValueError(
            f"{type(copier).__name__}.{method}() returned {shown}; expected a "
            "concurrent.futures.Future (the transfer is failed, nothing is in flight)"
        )
    return answer


_repr = reprlib.Repr()
_repr.maxother = 80  # an object's default repr, its address included
