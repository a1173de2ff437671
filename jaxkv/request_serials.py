"""Serial numbers of queued requests: the source of default request ids (and seeds).

Engine and PrefixAwareRouter number the requests they queue. Serial n gives the default
id `id_prefix + str(n)` (skipping ids a caller already holds); the engine also derives a
request's default sampling seed from its serial. A serial is taken only once its request
is queued, so a refused request leaves later ids and seeds as they would have been; a
checkpoint extends that to requests queued and then aborted again (generate refusing
its k-th prompt after queueing the ones before it).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence

_NONE = object()  # held by no request


class RequestSerials:
    """The next serial, and the default ids it gives."""

    def __init__(self, id_prefix: str = "") -> None:
        self.id_prefix = id_prefix
        self.next = 0  # the serial of the next queued request

    def peek(self, request_id: str | None, taken: Container[str]) -> tuple[int, str]:
        """(serial, id) of the next request: `request_id` if given, else the first default
        id from the next serial on that `taken` does not hold. Changes nothing."""
        serial = self.next
        if request_id is None:
            while f"{self.id_prefix}{serial}" in taken:  # a caller took that id
                serial += 1
            request_id = f"{self.id_prefix}{serial}"
        return serial, request_id

    def take(self, serial: int) -> None:
        """Records that the request given `serial` by peek() has been queued."""
        self.next = serial + 1

    def checkpoint(self, live: Mapping[str, object]) -> SerialsCheckpoint:
        """A SerialsCheckpoint of the next serial as it is now; `live` is the owner's live
        mapping of request ids to their requests."""
        return SerialsCheckpoint(self, live)


class SerialsCheckpoint:
    """Called, sets the next serial of `serials` back to the one it was at creation.

    The call, and check(), raise RuntimeError, changing nothing, while `live` (the owner's
    live mapping of request ids to their requests) holds a request it did not hold then
    (by identity: an id released and queued again since counts as new): that request
    keeps the serial (its seed) a later one would take again.
    """

    def __init__(self, serials: RequestSerials, live: Mapping[str, object]) -> None:
        self._serials, self._serial = serials, serials.next
        self._live, self._before = live, dict(live)

    def check(self) -> None:
        """Raises the RuntimeError a call would raise now; changes nothing either way."""
        before = self._before
        since = [rid for rid, held in self._live.items() if before.get(rid, _NONE) is not held]
        if since:
            raise RuntimeError(
                f"requests {since[:3]} queued since the checkpoint are still held; "
                "abort them (and let their KV copies land) before rewinding"
            )

    def __call__(self) -> None:
        self.check()
        self._serials.next = self._serial


def rewind_together(rewinds: Sequence[Callable[[], None]], then: Callable[[], None]):
    """A function that calls each of `rewinds`, then `then`, raising (changing nothing)
    where one refuses: it first calls check() on those that have it (SerialsCheckpoint),
    then calls those without it (their call is their check), and only then rewinds the
    checked ones. Of two or more without check(), a refusal by the first still changes
    nothing; one by a later one comes after an earlier one rewound, so the rewind is
    completed as far as it can be (the others without check(), then the checked ones
    and `then`) before the first refusal is raised, a note naming any further one."""
    checked = [r for r in rewinds if hasattr(r, "check")]
    unchecked = [r for r in rewinds if not hasattr(r, "check")]

    def rewind() -> None:
        for checkpoint in checked:
            checkpoint.check()  # raises while a request queued since is held
        refusals: list[BaseException] = []
        for i, rewind_unchecked in enumerate(unchecked):  # before any checked change
            try:
                rewind_unchecked()
            except BaseException as refusal:
                if i == 0:
                    raise  # nothing changed yet
                refusals.append(refusal)
        for checkpoint in checked:
            checkpoint()
        then()
        if refusals:
            for later in refusals[1:]:
                refusals[0].add_note(f"a later replica rewind also refused: {later!r}")
            raise refusals[0]

    return rewind
