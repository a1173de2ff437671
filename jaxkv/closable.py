"""Closable: what a closed object refuses, and `with` blocks that close it."""

from __future__ import annotations

from typing import Self


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
