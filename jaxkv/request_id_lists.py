"""The request ids an abort is given: one id, or any iterable of ids (as in vLLM)."""

from __future__ import annotations

from collections.abc import Iterable


def checked_request_ids(request_ids: str | Iterable[str]) -> list[str]:
    """[request_ids] for one id (a str), else the ids of the iterable, in its order (an
    iterator is consumed). ValueError naming `request_ids` unless it is a str or an
    iterable of str: a caller aborting a list refuses it whole rather than in part."""
    if isinstance(request_ids, str):
        return [request_ids]
    if isinstance(request_ids, (bytes, bytearray)) or not isinstance(request_ids, Iterable):
        raise ValueError(f"{request_ids=} must be a request id (a str) or an iterable of them")
    try:
        ids = list(request_ids)
    except TypeError:  # iterable by its type only: a 0-d numpy array, np.array("a")
        raise ValueError(
            f"{request_ids=} must be a request id (a str) or an iterable of them"
        ) from None
    wrong = [rid for rid in ids if not isinstance(rid, str)]
    if wrong:
        raise ValueError(
            f"request_ids holds {wrong[0]!r} ({type(wrong[0]).__name__}): each must be a "
            "request id (a str); none was aborted"
        )
    return ids
