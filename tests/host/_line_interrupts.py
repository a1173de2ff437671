"""A Ctrl-C at a chosen line of jaxkv's code: SIGINT raised at the n-th line that runs."""

from __future__ import annotations

import dis
import linecache
import pathlib
import signal
import sys

import jaxkv

PACKAGE = str(pathlib.Path(jaxkv.__file__).parent)
_NOP = dis.opmap["NOP"]


class LineInterrupts:
    """Inside `with`, raises SIGINT (signal.raise_signal: the installed handler runs at
    once, as Python runs it at a line) before the `at`-th line that runs in the jaxkv
    modules named `files` (all if None), counting across every use of this object.
    `fired`: the stack of (file path, line) where it was raised, innermost first; None
    while not yet."""

    def __init__(self, at: int | None, files: set[str] | None = None) -> None:
        self.at = at
        self.files = None if files is None else {f"{PACKAGE}/{name}" for name in files}
        self.count = 0
        self.fired: list[tuple[str, int]] | None = None
        self._previous = None

    def __enter__(self) -> LineInterrupts:
        self._previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc_info) -> None:
        sys.settrace(self._previous)

    def _call(self, frame, event, arg):
        name = frame.f_code.co_filename
        if self.fired is None and (
            name.startswith(PACKAGE) if self.files is None else name in self.files
        ):
            return self._line
        return None

    def _line(self, frame, event, arg):
        if self.fired is not None:
            return None
        if event != "line" or frame.f_code.co_code[frame.f_lasti] == _NOP:
            return self._line  # a signal is never handled at a NOP (a `try:` line)
        self.count += 1
        if self.count == self.at:
            self.fired = []
            f = frame
            while f is not None:
                self.fired.append((f.f_code.co_filename, f.f_lineno))
                f = f.f_back
            signal.raise_signal(signal.SIGINT)
        return self._line


def fired_in(fired: list[tuple[str, int]], calls: tuple[str, ...]) -> bool:
    """Whether the innermost line `fired` names one of `calls` (source text fragments)."""
    path, line = fired[0]
    return any(call in linecache.getline(path, line) for call in calls)


def raised_at_once(error: BaseException) -> bool:
    """Raised where the signal came (LineInterrupts), not once a held block ended."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != __file__:
        tb = tb.tb_next
    return tb is not None
