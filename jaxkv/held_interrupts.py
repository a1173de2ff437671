"""Ctrl-C held back while host bookkeeping that must not stop halfway runs.

Python runs a SIGINT handler (KeyboardInterrupt) at the next bytecode that looks for
signals, which may be any call. These places may not be cut there:

- a jitted call that donates the KV caches (the engine's step program, the KV copier's
  load scatter) deletes them and returns their replacement. A Ctrl-C that arrived while
  it ran was raised right after it returned, the new caches dropped with its result,
  and the engine held only deleted ones (every later step raised "Buffer has been
  deleted or donated");
- a KV connector's poll() forgets the copies it reports: raised before the scheduler
  applied the report, an interrupt left their blocks held for good;
- the scheduler's update of a step: cut between a request's computed tokens and its
  token, it left the request with nothing to compute; and its schedule(): cut in the
  manager's allocation, it left a block half taken off the free queue; and its
  add_request: cut between its request map and its waiting queue, it left a request
  that nothing would run and no abort could remove, its id in use for good;
- the block pool's reset_prefix_cache: cut midway, it left blocks without their hash in
  the hash map, where a later hit found one holding another request's KV;
- Engine.add_request: cut between queueing a request's samples and recording them as
  its own, it left the request's id in use for good; before its serial was taken, the
  next request got the same default seed;
- Engine.abort: cut after the scheduler released a request, it kept the request's
  sampling row and samples (its id in use for good); between two samples, one ran on;
- PrefixAwareRouter.add_request once its replica queued the request: cut there, the
  request ran untracked (its outputs dropped, its id unabortable) or was counted as
  outstanding for good; its abort, cut after a replica's abort, and its step, cut as
  it released the finished requests: those counted for good, their replica idle;
- Engine.step from its update to its end: cut in the closing bookkeeping, finished
  requests kept their sampling rows (under n > 1 their parent's id, in use for good);
- a KV connector's on_finish that started a save: raised before the scheduler held the
  finished request's blocks for it, an interrupt freed them under the save.

Inside `holding_interrupts()` a SIGINT is recorded instead, and raised again (to the
handler that was installed) on leaving the block. A held block that calls user code
marks the call with a UserCode, so that a Ctrl-C still stops it at once, where an
interrupt out of it leaves nothing to track: a tokenizer, a KV connector's
on_admission and start_load (whose interrupt means that no load started), and a
router's replica's add_request (whose interrupt aborts the request there) and step
(whose interrupt is that replica's step failing).
"""

from __future__ import annotations

import _signal  # signal's own functions, without its enum conversions (10x slower)
import signal
import threading
from collections.abc import Callable

__all__ = ["UserCode", "holding_interrupts"]

_SIGINT = int(signal.SIGINT)


class holding_interrupts:  # noqa: N801 - used as a context manager, like contextlib's
    """Holds back SIGINT inside the block (if `hold`), in the main thread (the only one
    a signal interrupts), where the installed handler was set from Python (otherwise it
    could not be put back); raises it again on leaving the block. Costs about 1 us.

    `passes_on` (a function): a SIGINT handled while it returns True is passed on at
    once. A donating call's is "the donated caches are not deleted yet": a Ctrl-C while
    jax traces or compiles a new program (before the donation) stops it without waiting
    for a compile that may take minutes, and is held from the donation on."""

    __slots__ = ("_passes_on", "_hold", "_previous", "_caught")

    def __init__(self, hold: bool = True, *, passes_on: Callable[[], bool] | None = None) -> None:
        self._passes_on = passes_on
        self._hold = hold and threading.current_thread() is threading.main_thread()
        self._previous = None
        self._caught = False

    def _record(self, signum, frame) -> None:
        if self._passes_on is not None and self._passes_on():
            self._caught = False  # an earlier one is passed on now too
            previous = self._previous
            if callable(previous):
                previous(signum, frame)
            elif previous != _signal.SIG_IGN:  # SIG_DFL: on leaving the block
                self._caught = True
        else:
            self._caught = True

    def __enter__(self) -> None:
        if self._hold:
            previous = _signal.getsignal(_SIGINT)
            if previous is None:  # installed outside Python: it could not be restored
                self._hold = False
                return
            self._previous = previous
            _signal.signal(_SIGINT, self._record)

    def __exit__(self, *exc_info) -> None:
        if self._hold:
            _signal.signal(_SIGINT, self._previous)
            if self._caught:
                signal.raise_signal(_SIGINT)  # to the handler the caller had


class UserCode:
    """passes_on for a held block that calls code it does not own (a tokenizer, a KV
    connector), which a Ctrl-C must stop at once, as it would unheld: True while `runs`.
    The caller sets `runs` just around the call, and handles what that call's interrupt
    leaves as it handles that call's exceptions."""

    __slots__ = ("runs",)

    def __init__(self) -> None:
        self.runs = False

    def __call__(self) -> bool:
        return self.runs

    def call(self, function: Callable, *args, **kwargs):
        """function(*args, **kwargs), `runs` set just around it."""
        self.runs = True
        try:
            return function(*args, **kwargs)
        finally:
            self.runs = False
