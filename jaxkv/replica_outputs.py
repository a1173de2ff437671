"""What a replica's step() may return to PrefixAwareRouter: the checks of its outputs.

Each output must be a RequestOutput of a sequence the replica runs for the router (its
request_id a str, its index an int and no bool), none twice or after the output that
finished its request, each finished one with a finish_reason, and a finish_reason
without finished only on a sample's (a request of n > 1). A sequence is keyed by
sequence_key: `request_id` for sample index 0, `(request_id, i)` for the others.

outputs_fit checks a whole step's outputs with a few passes of C over them (set
operations), not a Python loop; passing_outputs checks them output by output, and runs
only once outputs_fit has found something wrong (CheckedReplicas.step in
jaxkv.replica_checks).
"""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Callable
from itertools import compress, repeat

import numpy as np

from jaxkv.outputs import RequestOutput

__all__ = ["outputs_fit", "passing_outputs", "request_of", "sequence_key", "shown"]

# RequestOutput's fields by position: itemgetter runs in C.
_request_id = operator.itemgetter(0)
_finished = operator.itemgetter(2)
_finish_reason = operator.itemgetter(3)
_index = operator.itemgetter(5)
_sequence = operator.itemgetter(0, 5)  # (request_id, index)
_REASON_TYPES = {str, type(None)}

_repr = reprlib.Repr()
_repr.maxother = 80  # an object's default repr, its address included


def sequence_key(request_id: str, index: int) -> str | tuple[str, int]:
    """The key of sample `index` of request `request_id` (see the module doc)."""
    return request_id if index == 0 else (request_id, index)


def request_of(key: str | tuple[str, int]) -> str:
    """The request id of a sequence_key."""
    return key[0] if type(key) is tuple else key


def shown(value: object) -> str:
    """`value` as an error message shows a replica's answer: its repr, cut short."""
    return _repr.repr(value)


def outputs_fit(
    result: list,
    running: set[str | tuple[str, int]],
    is_parent: Callable[[str], bool],
) -> bool:
    """Whether `result` passes step's checks (the module doc), `running` the sequences
    the replica runs for the router and `is_parent` telling a request of n > 1 with a
    sample still running: passes of C over it, and a loop over its finished outputs
    only (one per request)."""
    if not set(map(type, result)) <= {RequestOutput}:
        return False
    if not set(map(type, map(_request_id, result))) <= {str}:  # ("x", 1): sample 1's key
        return False
    if not set(map(type, map(_index, result))) <= {int}:  # False, 0.0 == 0: sample 0's
        return False
    if not set(map(type, map(_finished, result))) <= {bool}:  # read by truth below
        return False
    if not set(map(type, map(_finish_reason, result))) <= _REASON_TYPES:  # compared too
        return False
    if set(map(_index, result)) <= {0}:  # no sample beyond a request's first
        keys = set(map(_request_id, result))
    else:
        firsts = compress(result, map(operator.eq, map(_index, result), repeat(0)))
        others = compress(result, map(operator.ne, map(_index, result), repeat(0)))
        keys = set(map(_request_id, firsts)) | set(map(_sequence, others))
    num_ending = len(result) - list(map(_finish_reason, result)).count(None)
    if len(keys) != len(result) or not keys <= running:
        return False
    last = None  # request id -> its last output in `result`
    done = list(compress(result, map(_finished, result)))
    for o in done:
        if o.finish_reason is None:
            return False
        if is_parent(o.request_id):  # its samples' outputs come before it
            last = last or dict(zip(map(_request_id, result), result, strict=True))
            if last[o.request_id] is not o:
                return False
    if num_ending == len(done):
        return True
    reasons = map(operator.is_not, map(_finish_reason, result), repeat(None))
    return all(o.finished or is_parent(o.request_id) for o in compress(result, reasons))


def passing_outputs(
    outputs: list,
    running: set[str | tuple[str, int]],
    is_parent: Callable[[str], bool],
) -> tuple[list[RequestOutput], str | None]:
    """The outputs that pass step's checks, in order, each checked against those kept
    before it (as outputs_fit reads them: `running`, `is_parent`), and what is wrong with
    the first that does not (None if all pass)."""
    kept: list[RequestOutput] = []
    seen: set[str | tuple[str, int]] = set()
    finished: set[str] = set()
    first = None
    for o in outputs:
        problem = _problem(o, running, seen, finished, is_parent)
        if problem is None:
            kept.append(o)
            seen.add(sequence_key(o.request_id, o.index))
            if o.finished:
                finished.add(o.request_id)
        elif first is None:
            first = problem
    return kept, first


def _problem(
    o: object,
    running: set[str | tuple[str, int]],
    seen: set[str | tuple[str, int]],
    finished: set[str],
    is_parent: Callable[[str], bool],
) -> str | None:
    """What is wrong with output `o` of a replica's step (None if nothing), given the
    outputs before it: `seen` their sequences, `finished` the requests they finished."""
    if not isinstance(o, RequestOutput):
        return f"{shown(o)}, not a RequestOutput"
    if not isinstance(o.request_id, str):  # ("x", 1) would pass for sample 1 of "x"
        return f"an output of request_id {shown(o.request_id)}, not a str"
    if not isinstance(o.index, int) or isinstance(o.index, bool):  # False == 0, hashed alike
        return f"an output of request {o.request_id!r} with index {shown(o.index)}, not an int"
    # An array here raised a ValueError naming nothing when read by its truth.
    if not isinstance(o.finished, (bool, np.bool_)):
        return f"an output of request {o.request_id!r} with finished={shown(o.finished)}, no bool"
    if not isinstance(o.finish_reason, (str, type(None))):
        reason = shown(o.finish_reason)
        return f"an output of request {o.request_id!r} with finish_reason={reason}, no str"
    key = sequence_key(o.request_id, o.index)
    what = (
        f"an output of request {o.request_id!r} (index {o.index!r}, finished="
        f"{o.finished!r}, finish_reason={o.finish_reason!r})"
    )
    if o.request_id in finished:
        return f"{what} after the output that finished that request"
    if key in seen:
        return f"{what} twice"
    if key not in running:
        return (
            f"{what}, a sequence it does not run for the router (sent to another "
            "replica, or one that ended)"
        )
    if o.finished and o.finish_reason is None:
        return f"{what}: finished without a finish_reason"
    if o.finish_reason is not None and not o.finished and not is_parent(o.request_id):
        return f"{what}: a finish_reason on a request of one sample that is not finished"
    return None
