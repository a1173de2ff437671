"""What a request id is, and the request ids an abort is given: one id, or any iterable
of ids (as in vLLM)."""

from __future__ import annotations

from collections.abc import Iterable

from jaxkv.hashing import is_hash_key


def is_id_text(value: object) -> bool:
    """Whether `value` is a str that encodes as UTF-8, as every request id (and cache
    salt) must: one holding a lone surrogate ("a\\ud800") is not. Ids go into logs, JSON
    outputs and routers' maps. An ASCII id, the common case, costs one str.isascii().
    Request, PrefixAwareRouter.add_request and the aborts (Engine's, the router's, the
    Scheduler's) refuse any other id by name."""
    return isinstance(value, str) and (str.isascii(value) or is_hash_key(value))


def plain_id(request_id: str) -> str:
    """`request_id` (a str) as an exact str. A str subclass keeps the text it holds but
    not its own __hash__ or __eq__: one hashing apart from that text let a second request
    run under an id in use and missed it in every lookup, and one without a hash raised
    TypeError naming no argument."""
    return request_id if type(request_id) is str else str.__str__(request_id)


def checked_request_ids(request_ids: str | Iterable[str]) -> list[str]:
    """[request_ids] for one id (a str), else the ids of the iterable, in its order (an
    iterator is consumed). ValueError naming `request_ids` unless it is an id (is_id_text)
    or an iterable of them: a caller aborting a list refuses it whole rather than in part.
    Each id is returned as an exact str (plain_id)."""
    expected = "must be a request id (a str encodable as UTF-8)"
    if isinstance(request_ids, str):
        if not is_id_text(request_ids):
            raise ValueError(f"{request_ids=} {expected}")
        return [plain_id(request_ids)]
    if isinstance(request_ids, (bytes, bytearray)) or not isinstance(request_ids, Iterable):
        raise ValueError(f"{request_ids=} {expected} or an iterable of them")
    try:
        ids = list(request_ids)
    except TypeError:  # iterable by its type only: a 0-d numpy array, np.array("a")
        raise ValueError(f"{request_ids=} {expected} or an iterable of them") from None
    wrong = [rid for rid in ids if not is_id_text(rid)]
    if wrong:
        raise ValueError(
            f"request_ids holds {wrong[0]!r} ({type(wrong[0]).__name__}): each {expected}; "
            "none was aborted"
        )
    return [plain_id(rid) for rid in ids]
