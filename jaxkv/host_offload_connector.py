"""HostOffloadConnector: the KVConnector that keeps finished requests' full blocks in an
LRU host store and reloads them on a later device-cache miss (see jaxkv.kv_transfer for
the connector's hooks and when the Scheduler calls them)."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Sequence

import numpy as np

from jaxkv.allocation_args import checked_request_id, count
from jaxkv.copier_layout import (
    UNBOUND,
    StoreLayout,
    checked_block_ids,
    checked_copied_blocks,
    declared_num_blocks,
    load_span,
    store_layout,
)
from jaxkv.field_checks import checked_int
from jaxkv.hashing import BlockHash
from jaxkv.held_interrupts import UserCode
from jaxkv.host_block_store import HostBlockStore
from jaxkv.kv_transfer import KVConnector, KVCopier, TransferEvents, TransferStats
from jaxkv.offload_transfers import (
    Transfer,
    check_not_in_flight,
    collect,
    copy_result,
    is_closed,
    started,
)
from jaxkv.request import Request

logger = logging.getLogger(__name__)


class HostOffloadConnector(KVConnector):
    """Offloads finished requests' full blocks to an LRU host store; reloads prefix hits.

    The store maps block hash -> host copy of that block (every layer), holding at most
    `host_bytes` bytes (each entry its own array); the least recently saved or loaded
    block is evicted first, and within one request's blocks the last first, since a
    prefix is only usable from its first block (a save or load refreshes the whole
    prefix). A block loads only behind its whole prefix, held in the store or in the
    device's prefix cache: blocks stored behind a gap in the store (their parent evicted,
    dropped by a failed load, or never stored because its save failed) are demoted, the
    next to be evicted (see jaxkv.host_block_store). Only blocks whose every token was
    computed are saved, and a hash already stored or being saved is not copied twice. A
    failed save (its copy raised, or returned no array of as many blocks as it was given,
    or blocks of another size than the copier's bytes_per_block, or of another shape or
    dtype than its block_shape and dtype, or, where it declares none, than the blocks the
    store holds, or the store's copy of a block raised, out of host memory) frees the
    blocks and stores nothing, so the store keeps within host_bytes, every stored block
    has one shape and dtype and a load's blocks always make one array; a failed load,
    whether its copy failed or the copier's start_load raised, drops the store entries it
    read (so a retry recomputes; a copy of one saved again since is kept) and the
    scheduler frees the blocks and recomputes the tokens: nothing leaks, nothing is
    half-loaded, and no request waits on a load that fails every time. Each failed copy
    is logged as a warning naming its request and the copy's exception (raised on the
    copy thread) or what is wrong with its result; a start_load's exception propagates
    instead.

    copy_delay_steps > 0 reports a transfer no earlier than that many poll() calls after
    it started (to hold blocks on purpose in tests and benchmarks).

    It serves one engine at a time: bind refuses a second copier while the first one's
    engine lives and is not closed (Engine.close unbinds it), since one engine's saves
    through another's copier would store that engine's KV under the first one's hashes.
    It holds the copier weakly, so an engine dropped without close() is still collected;
    the copies it had in flight are then forgotten: from the connector's first call after
    the collection (has_pending, poll and stats included), they are no longer pending but
    failed, and the blocks stored behind their unsaved ones are demoted. The store
    outlives the engine: a later engine bound with the same block size, hash seed, block
    layout (bytes, shape and dtype of a block, which holds each KV head once whatever the
    tensor-parallel width) and model (the copier's model_fingerprint: config and weights'
    bits, wherever the weights are placed) reads what the earlier one saved; any other
    binding empties it, so KV one model computed is never loaded into another's cache.
    """

    def __init__(self, host_bytes: int, *, copy_delay_steps: int = 0) -> None:
        self._store = HostBlockStore()
        self._layout: StoreLayout = UNBOUND  # of the blocks in the store
        # A bool is no size: HostOffloadConnector(True) was a 1-byte store that never saved.
        self.host_bytes = host_bytes
        self.copy_delay_steps = copy_delay_steps
        self._copier_ref: weakref.ref[KVCopier] | None = None
        self._num_blocks: int | None = None  # the bound copier's, where it declares them
        self._saves: dict[str, Transfer] = {}
        self._loads: dict[str, Transfer] = {}
        self._saving: set[BlockHash] = set()  # hashes with a save in flight
        self._step = 0
        self._stats = TransferStats()
        self._user_code = UserCode()  # set around the copier's calls (marks_user_code)

    @property
    def host_bytes(self) -> int:
        """The store's limit in bytes. Set to an int >= 0 (ValueError naming it otherwise,
        nothing changed), the store evicts down to it at once."""
        return self._host_bytes

    @host_bytes.setter
    def host_bytes(self, value: int) -> None:
        self._host_bytes = checked_int("host_bytes", value, minimum=0)
        self._evict()

    @property
    def copy_delay_steps(self) -> int:
        """See the class doc. Set to an int >= 0 (ValueError naming it otherwise, nothing
        changed), it applies to the copies in flight too."""
        return self._copy_delay_steps

    @copy_delay_steps.setter
    def copy_delay_steps(self, value: int) -> None:
        self._copy_delay_steps = checked_int("copy_delay_steps", value, minimum=0)

    def bind(self, copier: KVCopier, *, block_size: int, hash_seed: int) -> None:
        """Serves the engine of `copier` from now on, holding it weakly (its engine keeps
        it). Raises RuntimeError, changing nothing, while bound to another live copier,
        or to `copier` under another layout (block size, hash seed, or the copier's block
        layout or model) while a copy is in flight: a save would land under the old
        layout's hashes. Raises ValueError, changing nothing, unless `block_size` and
        `copier.bytes_per_block` are ints >= 1, `hash_seed` an int that fits in 64 bits,
        and, where the copier declares them, its block_shape ints >= 1, dtype what numpy
        takes (a block of both holding bytes_per_block bytes) and num_blocks an int >= 1."""
        layout = store_layout(copier, block_size, hash_seed)
        num_blocks = declared_num_blocks(copier)
        bound = self._bound()
        if bound is not copier:
            self.check_can_bind()
        if bound is copier and layout != self._layout and self.has_pending():
            raise RuntimeError(
                f"bind of the bound copier with another layout while {len(self._saves)} "
                f"saves and {len(self._loads)} loads are in flight (a save would land under "
                "the old layout's hashes): poll() until has_pending() is False first"
            )
        if layout != self._layout:
            self._store.clear()  # saved for other blocks: not this engine's KV
        self._layout = layout
        self._num_blocks = num_blocks
        self._copier_ref = weakref.ref(copier)

    def check_can_bind(self) -> None:
        """RuntimeError while bound to a live engine's copier (see bind)."""
        if self._bound() is not None:
            raise RuntimeError(
                "this HostOffloadConnector serves another engine: close that engine "
                "(Engine.close) first, or give each engine its own connector"
            )

    def unbind(self, copier: KVCopier) -> None:
        """Lets bind take another engine's copier, if `copier` is the one bound (otherwise
        does nothing); the store is kept. Raises RuntimeError, changing nothing, while a
        copy is in flight (poll reports its end), unless `copier.closed` is a bool and True
        (Engine.close went on past copies that did not land): they are forgotten, unstored."""
        if self._bound() is not copier:
            return
        if self.has_pending() and not is_closed(copier):
            raise RuntimeError(
                f"unbind with {len(self._saves)} saves and {len(self._loads)} loads in flight"
            )
        self._unbind()

    # ------------------------------------------------------------------ hooks

    def marks_user_code(self, user_code: UserCode) -> bool:
        """Sets `user_code` just around the copier's start_save and start_load: a copy
        started is then recorded whole, never freed under it by an interrupt."""
        self._user_code = user_code
        return True

    def on_finish(self, request: Request, block_ids: Sequence[int]) -> bool:
        """Starts saving the finished request's full blocks the store lacks (True: keep
        them held until poll() reports the save) and refreshes those it holds. Raises
        ValueError, starting nothing, unless `request` is a Request and `block_ids` are
        distinct block ids (one saved under two hashes would be the wrong KV for one of
        them), each >= 1 and, where the copier declares num_blocks, below it, or while a
        save of the request's id is in flight (its report would be lost). An exception
        from the copier's start_save, or ValueError naming what it returned if that is
        no concurrent.futures.Future, propagates with this connector unchanged (its
        store's LRU order included); the scheduler then frees the blocks unsaved and the
        request ends: unlike a load, a save is not tried again."""
        req_id = checked_request_id(request)
        copier = self._require_copier()
        block_ids = checked_block_ids(block_ids, f"on_finish({req_id!r})", self._num_blocks)
        check_not_in_flight("on_finish", req_id, self._saves)
        if self.host_bytes < self._layout.bytes_per_block:
            return False
        hashes = request.update_block_hashes(self._layout.block_size, self._layout.hash_seed)
        num_full = min(request.num_computed_tokens // self._layout.block_size, len(block_ids))
        picked, stored = [], []
        for i in reversed(range(num_full)):  # a chain's head ends up most recently used
            h = hashes[i]
            if h in self._store:
                stored.append(h)
            elif h not in self._saving:
                picked.append((block_ids[i], h))
        picked.reverse()
        future = None
        if picked:
            ids = [b for b, _ in picked]
            future = started(copier, "start_save", self._user_code, ids)
        for h in stored:  # used again, once start_save did not raise: refresh them
            self._store.touch(h)
        if future is None:
            return False
        new_hashes = [h for _, h in picked]
        chain = hashes[:num_full]
        self._saves[req_id] = Transfer(req_id, future, new_hashes, self._step, chain=chain)
        self._saving.update(new_hashes)
        return True

    def on_admission(self, request: Request, num_computed_tokens: int) -> int:
        """Whole blocks after `num_computed_tokens` found in the store, in tokens. Never
        covers the request's last token (its logits must be computed); 0 while no live
        copier is bound (the store outlives its engine, but start_load needs one). Changes
        no state. Raises ValueError unless `request` is a Request and `num_computed_tokens`
        an int >= 0."""
        req_id = checked_request_id(request)
        num_computed_tokens = count("num_computed_tokens", num_computed_tokens, req_id)
        bs = self._layout.block_size
        # Unbound (its engine closed), start_load would refuse every claim, every time.
        if not self._store or num_computed_tokens % bs or self._bound() is None:
            return 0
        hashes = request.update_block_hashes(bs, self._layout.hash_seed)
        first = num_computed_tokens // bs
        last = (request.num_tokens - 1) // bs
        num_found = 0
        for h in hashes[first:last]:
            if h not in self._store:
                break
            num_found += 1
        return num_found * bs

    def start_load(self, request: Request, block_ids: Sequence[int]) -> None:
        """Loads the stored blocks that follow request.num_computed_tokens into
        `block_ids`. Raises ValueError (nothing started or changed) unless `request` is a
        Request, the blocks end before its last token and the store holds them all, as
        on_admission promised just before, `block_ids` are distinct ints >= 1 and, where
        the copier declares num_blocks, below it (the bound engine's cache less the null
        block 0), and no load of the request's id is in flight. The stored blocks always
        make one array of the copier's block_shape and dtype, where it declares them: a
        save of blocks of another shape or dtype than those stored fails.

        An Exception from the copier's start_load (ValueError naming what it returned,
        if that is no concurrent.futures.Future), or from gathering the stored blocks
        into one array (a MemoryError), is a load that failed to start: it propagates
        after the blocks the load was to read leave the store, as a failed load's do
        (counted in num_failed_loads, not logged: the caller has the exception), so no
        later on_admission claims them and the request recomputes them instead of
        failing the same way at every admission. An interrupt that is no
        Exception (Ctrl-C while the copy program compiles) says nothing of the load: it
        propagates with the store unchanged, and the next admission tries again."""
        req_id = checked_request_id(request)
        copier = self._require_copier()
        block_ids = checked_block_ids(block_ids, f"start_load({req_id!r})", self._num_blocks)
        check_not_in_flight("start_load", req_id, self._loads)
        call = f"start_load({req_id!r})"
        all_hashes, first = load_span(request, len(block_ids), self._layout, call)
        hashes = all_hashes[first : first + len(block_ids)]
        if not all(h in self._store for h in hashes):
            raise ValueError(f"start_load({req_id!r}): the store no longer holds those blocks")
        serials = [self._store.serial(h) for h in hashes]  # the copies this load reads
        try:
            # Inside the try: out of host memory here, the store kept the blocks, and
            # each later admission claimed them and could raise the same way again.
            data = np.stack([self._store[h] for h in hashes])
            future = started(copier, "start_load", self._user_code, block_ids, data)
        except Exception:
            self._load_failed(hashes, serials)  # or every later admission fails the same way
            raise
        # The whole prefix is used again (device hits too): refreshed tail first, as saved.
        for h in reversed(all_hashes[: first + len(hashes)]):
            if h in self._store:
                self._store.touch(h)
        num_tokens = len(hashes) * self._layout.block_size
        self._loads[req_id] = Transfer(req_id, future, hashes, self._step, num_tokens, serials)

    def poll(self) -> TransferEvents:
        self._bound()  # a collected copier's copies are forgotten, never reported
        self._step += 1
        step, delay = self._step, self.copy_delay_steps
        saved, failed_saves = collect(self._saves, self._finish_save, step, delay)
        loaded, failed_loads = collect(self._loads, self._finish_load, step, delay)
        return TransferEvents(tuple(saved), tuple(failed_saves), tuple(loaded), tuple(failed_loads))

    def has_pending(self) -> bool:
        self._bound()
        return bool(self._saves or self._loads)

    @property
    def stats(self) -> TransferStats:
        self._bound()
        n = len(self._store)
        return dataclasses.replace(
            self._stats, num_stored_blocks=n, stored_bytes=n * self._layout.bytes_per_block
        )

    def stored_hashes(self) -> list[BlockHash]:
        """Hashes in the host store, least recently used first."""
        self._bound()
        return list(self._store)

    # ---------------------------------------------------------------- helpers

    def _finish_save(self, t: Transfer) -> bool:
        try:
            # Made one array inside the try: blocks no array holds (ragged ones) fail the
            # save here, not in the store's put below, after collect dropped the transfer.
            held = next(iter(self._store.values()), None)  # all alike: each was checked
            data = checked_copied_blocks(copy_result(t.future), len(t.hashes), self._layout, held)
        except Exception as e:  # noqa: BLE001 - any copy failure frees the blocks the same way
            return self._save_failed(t, e)
        self._saving.difference_update(t.hashes)
        try:
            self._store.put_chain(t.chain, dict(zip(t.hashes, data, strict=True)), self._saving)
        except Exception as e:  # noqa: BLE001 - a MemoryError copying a block into the store
            # It escaped poll() with the transfer dropped: the request held its blocks for
            # good, and the other transfers that poll() had collected went unreported.
            for h in t.hashes:  # each was stored by this save only, if at all
                self._store.drop(h)
            return self._save_failed(t, e)
        self._evict()
        self._count(num_saves=1, bytes_offloaded=len(t.hashes) * self._layout.bytes_per_block)
        return True

    def _save_failed(self, t: Transfer, error: Exception) -> bool:
        """Ends save `t` unstored, logged and counted as failed; returns False."""
        logger.warning("KV save of %r failed, its blocks freed unsaved: %r", t.request_id, error)
        self._saves_ended_unstored(t.hashes)
        self._count(num_failed_saves=1)
        return False

    def _finish_load(self, t: Transfer) -> bool:
        try:
            copy_result(t.future)
        except Exception as e:  # noqa: BLE001 - any copy failure recomputes the same way
            logger.warning("KV load of %r failed, its tokens recomputed: %r", t.request_id, e)
            self._load_failed(t.hashes, t.serials)
            return False
        self._count(
            num_loads=1,
            bytes_reloaded=len(t.hashes) * self._layout.bytes_per_block,
            num_loaded_tokens=t.num_tokens,
        )
        return True

    def _load_failed(self, hashes: Sequence[BlockHash], serials: Sequence[int]) -> None:
        """A load of `hashes`, read as the entries of `serials`, failed: those entries
        leave the store, so no admission claims them again (the blocks stored behind them
        are demoted); a hash stored again since, by another save, keeps its new copy."""
        for h, serial in zip(hashes, serials, strict=True):
            self._store.drop(h, serial)
        self._count(num_failed_loads=1)

    def _evict(self) -> None:
        limit = self.host_bytes // max(self._layout.bytes_per_block, 1)
        self._store.evict_to(limit)

    def _unbind(self) -> None:
        """Ends the binding. No one will collect the copies in flight (their engine is
        gone or closed): they are forgotten, as failed ones."""
        self._count(num_failed_saves=len(self._saves), num_failed_loads=len(self._loads))
        self._saves.clear()
        self._loads.clear()
        self._saves_ended_unstored(list(self._saving))
        self._copier_ref = None

    def _saves_ended_unstored(self, hashes: Sequence[BlockHash]) -> None:
        """`hashes`, no longer being saved, were not stored: blocks stored behind them demote."""
        self._saving.difference_update(hashes)
        for h in hashes:
            self._store.demote_behind(h)

    def _count(self, **deltas: int) -> None:
        s = self._stats
        self._stats = dataclasses.replace(s, **{k: getattr(s, k) + v for k, v in deltas.items()})

    @property
    def hash_layout(self) -> tuple[int, int] | None:
        return None if self._bound() is None else (self._layout.block_size, self._layout.hash_seed)

    def _bound(self) -> KVCopier | None:
        """The bound copier, or None, unbound once collected: here, on the caller's thread,
        not in a weakref callback, run by whichever thread collects it, amid a poll()."""
        copier = None if self._copier_ref is None else self._copier_ref()
        if copier is None and self._copier_ref is not None:
            self._unbind()
        return copier

    def _require_copier(self) -> KVCopier:
        copier = self._bound()
        if copier is None:
            raise RuntimeError("HostOffloadConnector used unbound (bind(copier, ...) first)")
        return copier
