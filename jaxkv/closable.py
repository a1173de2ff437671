"""Closable: what a closed object refuses, and `with` blocks that close it."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable
from typing import NoReturn, Self, TypeVar

from jaxkv.field_checks import is_real

T = TypeVar("T")
R = TypeVar("R")


class Closable:
    """`closed`, `_check_open()` (RuntimeError once closed, or inside a call of a method
    wrapped by one_at_a_time or no_reentry; `_check_not_running()` only the latter) and
    `with` support: leaving the block calls close(). A subclass defines close() and sets
    `_closed` in it."""

    _closed = False
    _running: str | None = None  # the one_at_a_time method now running

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 60.0) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            name = type(self).__name__
            raise RuntimeError(f"the {name} is closed ({name}.close() was called)")
        self._check_not_running()

    def _check_not_running(self) -> None:
        """RuntimeError while a one_at_a_time method of this object runs."""
        if self._running is not None:
            name = type(self).__name__
            raise RuntimeError(
                f"the {name} is inside {name}.{self._running}(): a call back into it from "
                "there (a tokenizer's or connector's callback) is refused"
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def one_at_a_time(method):
    """`method` of a Closable, refusing (RuntimeError) to start once closed, and making
    every _check_open() call on the object refuse while it runs: a callback it makes (a
    tokenizer's decode during a step) cannot step, abort or add requests halfway through
    its bookkeeping."""
    return _one_at_a_time(method, "_check_open")


def no_reentry(method):
    """As one_at_a_time, but open after close too (PrefixAwareRouter.abort: a caller's
    cleanup may abort its ids after close): only a call from inside it, or from inside
    another method wrapped by either, is refused."""
    return _one_at_a_time(method, "_check_not_running")


def _one_at_a_time(method, check: str):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        getattr(self, check)()
        self._running = method.__name__
        try:
            return method(self, *args, **kwargs)
        finally:
            self._running = None

    return run


def checked_timeout(timeout_s) -> float:
    """`timeout_s` as a float; ValueError unless a number of seconds >= 0 (inf: no limit).

    Checked before a close or drain changes anything: "60" or None used to fail with a
    TypeError only after close had aborted every request, and NaN never timed out.
    """
    if not is_real(timeout_s) or not timeout_s >= 0:  # NaN fails the comparison
        raise ValueError(f"{timeout_s=} must be a number of seconds >= 0")
    try:
        return float(timeout_s)
    except OverflowError:  # an int past float's range, 10**400: no limit, as inf
        return math.inf


class TransfersPendingError(TimeoutError):
    """step_until_landed's TimeoutError: KV copies still in flight at its timeout. A
    TimeoutError that a step raised (a connector's socket timing out) is not one."""


def step_until_landed(pending: Callable[[], bool], step: Callable[[], bool], timeout_s) -> None:
    """Calls `step` while `pending()` (True: the KV copies it waits for are in flight),
    sleeping briefly after a step that returns False (nothing happened). Raises
    TransfersPendingError (a TimeoutError) when a step begun after `timeout_s` seconds
    leaves a copy in flight: a copy that landed in time is collected, under timeout_s=0
    too. ValueError, with no step taken, unless `timeout_s` is a number >= 0
    (checked_timeout)."""
    deadline = time.monotonic() + checked_timeout(timeout_s)
    while pending():
        late = time.monotonic() > deadline  # read before this step polls the copies
        if not step() and not late:
            time.sleep(0.0005)
        elif late and pending():
            raise TransfersPendingError(f"KV transfers still pending after {timeout_s=}")


def try_each(call: Callable[[T], R], args: Iterable[T], name: str) -> list[R]:
    """Calls `call(arg)` for each of `args`, those after one that raised an Exception
    included, and returns what they returned; or raises the first such Exception, with
    a note naming its call (`name(arg)`) and each later one that raised (an interrupt
    that is no Exception propagates at once). For calls that must each be tried (a
    close aborting every request)."""
    failed: list[tuple[str, Exception]] = []
    results: list[R] = []
    for arg in args:
        try:
            results.append(call(arg))
        except Exception as error:  # noqa: BLE001 - raised below, once every call was made
            failed.append((f"{name}({arg!r})", error))
    if failed:
        raise_first(failed, "every other call was made")
    return results


def raise_first(failed: list[tuple[str, Exception]], went_on: str) -> NoReturn:
    """Raises the first error of `failed` (pairs of what raised it and the error, in
    order), with a note naming what raised it, saying `went_on` (what was done after it
    all the same) and naming each later one (the first four, then how many more)."""
    (what, first), later = failed[0], failed[1:]
    shown = "; ".join(f"{w} raised {e!r}" for w, e in later[:4])
    more = f"; and {len(later) - 4} more" if len(later) > 4 else ""
    first.add_note(f"raised by {what}; {went_on}" + (f": {shown}{more}" if later else ""))
    raise first


def try_each_noted(call: Callable[[T], object], args: Iterable[T], name: str, error) -> None:
    """Calls `call(arg)` for each of `args`, those after one that raised an Exception
    included, noting each that raised (`name(arg)` and its error) on `error`, the one the
    caller is raising: for the cleanup after a failure, where a failing cleanup step must
    neither stop the others nor replace the error that needed them (an interrupt that is
    no Exception propagates at once)."""
    for arg in args:
        try:
            call(arg)
        except Exception as failure:  # noqa: BLE001 - noted on the error being raised
            error.add_note(f"cleaning up, {name}({arg!r}) raised {failure!r}")
