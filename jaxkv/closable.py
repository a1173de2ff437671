"""Closable: what a closed object refuses, and `with` blocks that close it."""

from __future__ import annotations

import math
from typing import Self

from jaxkv.field_checks import is_real


class Closable:
    """`closed`, `_check_open()` (RuntimeError once closed) and `with` support: leaving
    the block calls close(). A subclass defines close() and sets `_closed` in it."""

    _closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 60.0) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            name = type(self).__name__
            raise RuntimeError(f"the {name} is closed ({name}.close() was called)")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


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
