"""Serial numbers of queued requests: the source of default request ids (and seeds).

Engine and PrefixAwareRouter number the requests they queue. Serial n gives the default
id `id_prefix + str(n)` (skipping ids a caller already holds); the engine also derives a
request's default sampling seed from its serial. A serial is taken only once its request
is queued, so a refused request leaves later ids and seeds as they would have been; a
checkpoint extends that to requests queued and then aborted again (generate refusing
its k-th prompt after queueing the ones before it).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

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

    def checkpoint(self, live: Mapping[str, object]) -> Callable[[], None]:
        """A function that sets the next serial back to the one it is now.

        `live` is the owner's live mapping of request ids to their requests. The function
        raises RuntimeError, changing nothing, while it holds a request it did not hold at
        the checkpoint (by identity: an id released and queued again since counts as
        new): that request keeps the serial (its seed) a later one would take again.
        """
        serial, before = self.next, dict(live)

        def rewind() -> None:
            since = [rid for rid, held in live.items() if before.get(rid, _NONE) is not held]
            if since:
                raise RuntimeError(
                    f"requests {since[:3]} queued since the checkpoint are still held; "
                    "abort them (and let their KV copies land) before rewinding"
                )
            self.next = serial

        return rewind
