"""The running samples of a router's requests of SamplingParams.n > 1.

A replica serves sample i of request `rid` as the request "i_rid" (jaxkv.parallel_sampling)
and reports it under `rid` with index i. The router keeps which of them still run, so
that each counts as one outstanding sequence, a sample's own id can be aborted, and no
other request takes a running sample's id on any replica.
"""

from __future__ import annotations


class RunningSamples:
    """Parent request id -> indices of its samples still running (n > 1 requests only).

    `in` is True for the id of a running sample ("i_rid"), as IdsInUse asks of holders.
    """

    def __init__(self) -> None:
        self._live: dict[str, set[int]] = {}

    def __contains__(self, request_id: object) -> bool:
        return self.sample_of(request_id) is not None

    def add(self, parent: str, n: int) -> None:
        self._live[parent] = set(range(n))

    def is_parent(self, request_id: str) -> bool:
        """True for a request of n > 1 with a sample still running."""
        return request_id in self._live

    def sample_of(self, request_id: object) -> tuple[str, int] | None:
        """(parent id, index) if `request_id` is the id of a running sample, else None."""
        if not isinstance(request_id, str):
            return None
        index, sep, parent = request_id.partition("_")
        live = self._live.get(parent)
        if live is None or not (sep and index.isascii() and index.isdigit()):
            return None
        # No sample's index has 19 digits, and int() raises ValueError past 4300 of them.
        if len(index) > 18 or index != str(int(index)):
            return None  # "01_x" names no sample: sample 1 of "x" is "1_x"
        return (parent, int(index)) if int(index) in live else None

    def end(self, parent: str, index: int) -> bool:
        """Forgets a sample that ended; True if it was running."""
        live = self._live.get(parent)
        if live is None or index not in live:
            return False
        live.discard(index)
        return True

    def num_running(self, parent: str) -> int:
        return len(self._live.get(parent, ()))

    def running(self, parent: str) -> list[int]:
        """Indices of the parent's running samples, in order ([] for any other id)."""
        return sorted(self._live.get(parent, ()))

    def pop(self, request_id: str) -> int:
        """Forgets a request that ended; returns how many sequences it still counted for:
        its running samples under n > 1, else 1."""
        live = self._live.pop(request_id, None)
        return 1 if live is None else len(live)
