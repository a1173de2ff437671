"""KV transfer connectors: keep a finished request's KV beyond the device cache, bring it back.

A connector sees three moments of a request's life, all called by the Scheduler on the
host, never inside jit:

- on_finish(request, block_ids): the request produced its last token. Returning True
  keeps its blocks held (status FINISHED_TRANSFERRING) until poll() reports the save;
  the scheduler frees them then, whether the save succeeded or failed, and gives the
  request back the status it finished with. Raising counts as a save that failed to
  start: the blocks are freed at once, with a logged warning. An answer other than a
  bool (numpy's is one) is read by its truth, with a logged warning naming it: a truthy
  one may have started a save that reads the blocks, so they stay held until poll()
  reports it.
- poll(): once per step; reports saves and loads that landed or failed since the last
  call. The step loop never waits on a copy.
- on_admission(request, num_computed_tokens) -> tokens: a waiting request missed the
  device prefix cache after `num_computed_tokens`; the connector says how many further
  tokens (an int, numpy's too, 0 for none; else whole blocks, ending before the
  request's last token, whose logits must be computed; a preempted request's tokens
  include its outputs) it can supply; the scheduler refuses any other answer (None, a
  bool, a float) with ValueError naming it, changing nothing. The scheduler then
  allocates blocks for the rest of the request's tokens and calls
  start_load(request, block_ids) with the blocks for the supplied tokens; the request
  waits in WAITING_FOR_REMOTE_KV, holding its blocks, its num_computed_tokens at the
  device hit's end, until poll() reports the load; once it has landed,
  num_computed_tokens moves past the supplied tokens. A claim is a promise for this call
  only: no state is kept between the two. A failed load frees the blocks and the request
  waits again, and its next admission asks again; so does a start_load that raises,
  its exception propagating out of that schedule(). A connector should stop claiming
  what it failed to load or to start loading (as HostOffloadConnector drops those
  store entries); one that claims and fails for good keeps the request waiting for
  good, or makes every later schedule() raise.

Device access goes through a KVCopier (implemented next to the engine, which owns the
caches); this module imports no JAX, so connectors are testable with a fake copier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jaxkv.closable import try_each_noted
from jaxkv.request import Request

if TYPE_CHECKING:
    from jaxkv.held_interrupts import UserCode


class KVCopier(Protocol):
    """Asynchronous block copies between the device KV caches and host memory.

    Both calls return at once; the Future completes when the copy has landed (its
    result() raises if it failed). It must be a concurrent.futures.Future:
    HostOffloadConnector refuses any other answer with ValueError, failing that copy.
    A save reads the blocks' current contents in device order, so the blocks must stay
    held (unwritten by others) until it lands.
    """

    bytes_per_block: int
    # Optional: block_shape, dtype, and model_fingerprint (bytes naming the model that
    # computed the KV, jaxkv.model_fingerprint); HostOffloadConnector keeps its store only
    # across copiers that agree on all three, and fails a save whose blocks have another
    # shape or dtype than the copier declares (or, declaring none, than those it stores).
    # Also num_blocks (blocks in the cache, the null block 0 included): it then refuses
    # block ids outside [1, num_blocks) itself, changing nothing, where a start_load
    # raising on them would count as a failed load (it refuses ids < 1 either way).
    # And closed (a bool, True once its copy thread is stopped, jaxkv.kv_copy): a closed
    # copier may be unbound with copies in flight, which are then forgotten.

    def start_save(self, block_ids: Sequence[int]) -> Future:
        """Copies blocks to host; result(): array [len(block_ids), ...] (one entry per block)."""

    def start_load(self, block_ids: Sequence[int], blocks: np.ndarray) -> Future:
        """Writes host `blocks` ([len(block_ids), ...]) into the device blocks `block_ids`;
        the Future is done once they are written there, not merely copied to the device
        (a copier whose write runs in device order before any later step, as
        jaxkv.kv_copy's does, may return before it has run)."""


@dataclasses.dataclass(frozen=True)
class TransferEvents:
    """Transfers that completed since the previous poll(), by request id."""

    saved: tuple[str, ...] = ()  # saves that landed: free the request's blocks
    failed_saves: tuple[str, ...] = ()  # saves that failed: free the blocks all the same
    loaded: tuple[str, ...] = ()  # loads that landed: the tokens are computed
    failed_loads: tuple[str, ...] = ()  # loads that failed: free the blocks, recompute

    def __bool__(self) -> bool:
        return bool(self.saved or self.failed_saves or self.loaded or self.failed_loads)


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """Counters of a connector since it was built (bytes of KV, all layers)."""

    bytes_offloaded: int = 0  # landed device -> host copies
    bytes_reloaded: int = 0  # landed host -> device copies
    num_saves: int = 0
    num_loads: int = 0
    num_failed_saves: int = 0  # those that raised, or that a forced close lost in flight
    num_failed_loads: int = 0
    num_stored_blocks: int = 0  # blocks in the host store now
    stored_bytes: int = 0
    # Prompt tokens that landed loads copied in; a load lands and counts even when its
    # request was aborted or its step discarded meanwhile (that request recomputes them).
    num_loaded_tokens: int = 0


class KVConnector:
    """The no-op connector: never keeps blocks, never supplies KV. Base of real ones."""

    def check_can_bind(self) -> None:
        """Raises RuntimeError if bind would refuse a new engine for serving another one;
        called by the engine before it allocates its KV cache, so a refused engine
        allocates none."""

    def bind(self, copier: KVCopier, *, block_size: int, hash_seed: int) -> None:
        """Called by the engine when it is built, before its first step."""

    def unbind(self, copier: KVCopier) -> None:
        """Called by Engine.close, with the copier it bound, once that copier is closed:
        no copy is in flight, unless close went on past copies that did not land (a
        forced close, or a step that raised): those are lost with the engine."""

    def marks_user_code(self, user_code: UserCode) -> bool:
        """Called by the Scheduler that drives this connector with the flag it lets a
        Ctrl-C through on (jaxkv.held_interrupts.UserCode); it holds one back anywhere
        else. False (this base): the scheduler sets it around each call of on_admission
        and start_load (on_finish is always held: a save it started must stay held). True:
        the connector sets it itself, just around the code it calls that it does not own
        (HostOffloadConnector: its copier), so that an interrupt never cuts its own
        bookkeeping, such as a copy started but not recorded."""
        return False

    def on_finish(self, request: Request, block_ids: Sequence[int]) -> bool:
        """True to keep the finished request's blocks held until poll() reports its save;
        False frees them (any other answer is read by its truth: module docstring)."""
        return False

    def on_admission(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` this connector can load (module docstring)."""
        return 0

    def start_load(self, request: Request, block_ids: Sequence[int]) -> None:
        """Starts loading the tokens on_admission claimed into `block_ids`. An exception
        frees the blocks and propagates out of schedule(): stop claiming those tokens
        before raising (module doc)."""
        raise RuntimeError("start_load without a positive on_admission claim")

    def poll(self) -> TransferEvents:
        """Saves and loads that landed or failed since the last call, each reported once.
        The Scheduler ignores an entry for a copy it has not started or has already seen
        end, and raises ValueError naming it once it has applied the rest. It learns of a
        copy's end only from a report poll() returns: a poll() that raises must keep the
        copies it saw end for the next call, or their blocks stay held for good."""
        return TransferEvents()

    def has_pending(self) -> bool:
        """Whether any save or load is still in flight. For the connector's users: the
        Scheduler never calls it (it knows its copies in flight from poll() reports)."""
        return False

    @property
    def stats(self) -> TransferStats:
        return TransferStats()

    @property
    def hash_layout(self) -> tuple[int, int] | None:
        """(block_size, hash_seed) the connector hashes requests' blocks with, or None when
        it hashes none now (unbound, or a connector that keeps no blocks by hash). The
        Scheduler refuses a connector whose layout is not its manager's."""
        return None


def bound_stats(
    connector: KVConnector, copier: KVCopier, *, block_size: int, hash_seed: int
) -> TransferStats:
    """connector.bind(copier, ...), then connector.stats, for an engine to count only its
    own copies from. If reading them raises, `copier` is unbound again (an unbind that
    raises noted on that error) before it propagates: a connector left bound to an
    engine whose constructor failed refused every other engine while the traceback kept
    that engine alive."""
    connector.bind(copier, block_size=block_size, hash_seed=hash_seed)
    try:
        return connector.stats
    except BaseException as error:
        try_each_noted(connector.unbind, [copier], "unbind", error)
        raise
