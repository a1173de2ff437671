"""Per-request KV blocks and prefix-cache lookup over the block pool.

Plain Python and numpy, no JAX. Each request's blocks are mirrored into the host block
table (jaxkv.block_table), which also answers shared-prefix queries. The manager does not
care why a request holds blocks (running, preempted-but-kept, finished and still copying
KV out, receiving KV): a request holds its blocks from its first allocate_slots until
free(request).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv import batch_allocation, slot_allocation, unwritten_blocks
from jaxkv.allocation_args import (
    allocation_counts,
    check_computed_within_held,
    check_computed_within_tokens,
    check_prompt_fits,
    check_total_fits,
    checked_hit_tokens,
    checked_request_id,
    count,
    manager_args,
    not_the_owner_message,
    request_id_of,
    validated_computed_blocks,
)
from jaxkv.block_pool import BlockPool, KVCacheBlock, KVCacheEvent
from jaxkv.block_table import HostBlockTable, UnknownRequestError
from jaxkv.manager_integrity import check_manager_integrity
from jaxkv.prefix_cache_stats import PrefixCacheCounter, PrefixCacheStats
from jaxkv.request import Request
from jaxkv.request_id_lists import plain_id

__all__ = ["KVCacheManager", "PrefixCacheStats", "UnknownRequestError"]


class KVCacheManager:
    """Owns the block pool and every request's blocks; keeps the host block table.

    Public arrays (read-only views; valid until the next state-changing call):

    - `block_table`: i32[max_num_rows, max_blocks_per_seq]; row `rows_of([id])[0]` holds a
      request's block ids in order, 0 (the null block) after them. Rows are reused after
      free; the number of rows doubles when needed (so re-read the attribute).
    - `prefix_ids`: i64[max_num_rows, max_blocks_per_seq], column-major; prefix_ids[r, j]
      == prefix_ids[s, j] iff rows r and s hold identical block ids in columns 0..j; -1
      where the row holds no block at column j. Feed it to longest_common_prefix.

    `max_blocks_per_seq`, the most blocks one request can hold, is ceil(max_model_len /
    block_size), or num_blocks - 1 (every block but the null block) if that is fewer.

    State-changing calls validate their arguments first and change nothing on error.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        hash_seed: int = 0,
        enable_kv_cache_events: bool = False,
    ) -> None:
        num_blocks, block_size, max_model_len, hash_seed = manager_args(
            num_blocks, block_size, max_model_len, hash_seed,
            enable_prefix_caching=enable_prefix_caching,
            enable_kv_cache_events=enable_kv_cache_events,
        )  # fmt: skip
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.pool = BlockPool(
            num_blocks, enable_caching=enable_prefix_caching, enable_events=enable_kv_cache_events
        )
        # Capped by the pool: uncapped, max_model_len=2**31-1 gave an 8-block pool 384 GiB rows.
        self.max_blocks_per_seq = min(-(-max_model_len // block_size), num_blocks - 1)
        self._blocks: dict[str, list[KVCacheBlock]] = {}  # req_id -> held blocks, in order
        # The Request object each id's blocks were allocated for (another object reusing a
        # live id would cache the owner's KV under its own tokens' hashes).
        self._owner: dict[str, Request] = {}
        self._num_cached: dict[str, int] = {}  # req_id -> leading blocks already cached
        self._table = HostBlockTable(self.max_blocks_per_seq)
        self._lookups = PrefixCacheCounter()

    # ---------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by some request."""
        return self.pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the counters since the last reset_prefix_cache_stats()."""
        return self._lookups.stats

    def reset_prefix_cache_stats(self) -> PrefixCacheStats:
        """Returns the counters and starts new ones from zero."""
        return self._lookups.reset()

    @property
    def request_ids(self) -> list[str]:
        """Ids of every request that holds a row (blocks or not), in allocation order."""
        return list(self._blocks)

    def holds_row(self, request_id: str) -> bool:
        """Whether `request_id` holds a row (blocks or not): allocated and not yet freed.
        Raises ValueError naming request_id unless it is a str (a Request that holds a
        row was answered False)."""
        if not isinstance(request_id, str):
            raise ValueError(f"{request_id=} must be a request id (a str)")
        return plain_id(request_id) in self._blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The block ids `request_id` (or a Request's id) holds, in order. Raises
        UnknownRequestError; ValueError unless given a str or the Request that holds them."""
        req_id = request_id_of("request_id", request_id, self._owner)
        return [b.block_id for b in self._blocks_of(req_id)]

    @property
    def block_table(self) -> np.ndarray:
        """i32[num_rows, max_blocks_per_seq] host block table, read-only (the class doc)."""
        return self._table.block_table_view

    @property
    def prefix_ids(self) -> np.ndarray:
        """i64[num_rows, max_blocks_per_seq] exact prefix ids, read-only (the class doc)."""
        return self._table.prefix_ids_view

    @property
    def sharing_version(self) -> tuple[int, int]:
        """Changes whenever a request is freed or a cache hit is appended to a request.

        While it is unchanged, prefix_ids at the columns each request already holds stay
        as they are, and new columns hold prefix ids no other request has (fresh blocks).
        """
        return self._table.sharing_version

    @property
    def row_version(self) -> int:
        """Changes whenever a request is freed. While it is unchanged, every row of
        block_table belongs to the same request and holds the same leading blocks."""
        return self._table.row_version

    def rows_of(self, request_ids: Sequence[str]) -> np.ndarray:
        """i32[len(request_ids)] rows of block_table, in order. Raises UnknownRequestError.

        The result of the previous call is reused (a read-only array) when the ids are
        equal and no request has been freed since, as in consecutive decode steps of one
        batch; otherwise it costs one C-level dict lookup per id.
        """
        return self._table.rows_of(request_ids)

    def num_blocks_of(self, request_ids: Sequence[str]) -> np.ndarray:
        """i32[len(request_ids)] number of blocks each request holds."""
        return self._table.num_blocks_of_row[self._table.rows_of(request_ids)]

    def num_blocks_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """i32[len(rows)] number of blocks held in each of `rows` (from rows_of)."""
        return self._table.num_blocks_of_row[self._table.checked_rows(rows)]

    def num_common_prefix_blocks(self, request_ids: Sequence[str]) -> int:
        """How many leading blocks every request in `request_ids` holds at the same positions.

        Exact whatever else holds blocks: requests outside `request_ids` neither add to nor
        subtract from the answer. Zero ids give 0; one id gives its number of blocks.
        Raises UnknownRequestError (a ValueError) naming an id that holds no row (never
        allocated, or freed; a request allocated 0 tokens holds a row and gives 0), and
        ValueError naming an item that is not a str id (a Request, say).

        For two or more ids the answer of the previous call is reused while the id list
        is equal, no request has been freed and no cache hit has been appended: blocks
        freshly taken from the pool are held by one row only, so appending them to a row
        lies past every prefix it shares and cannot change the answer.
        """
        return self._table.num_common_prefix_blocks(request_ids)

    def num_common_prefix_blocks_of_rows(self, rows: np.ndarray) -> int:
        """num_common_prefix_blocks for block-table rows (as rows_of returns them).

        For callers that keep their batch's rows: no id lookup and no reuse of earlier
        answers. Rows must be live (held by a request); the answer is then exact.
        Raises ValueError unless `rows` is a 1-D sequence of rows of block_table.
        """
        return self._table.num_common_prefix_blocks_of_rows(self._table.checked_rows(rows))

    # ---------------------------------------------------------- prefix cache

    def get_computed_blocks(self, request: Request, *, count: bool = True) -> tuple[list[int], int]:
        """The longest run of leading full blocks of `request` already cached.

        Returns (block_ids, num_computed_tokens), never covering the request's last token (a
        preempted request's last output; its logits must be computed). Changes no block state;
        pass the result to allocate_slots before any call that changes the manager's state.
        With prefix caching on, counts the lookup in prefix_cache_stats unless `count` is
        False (see count_prefix_lookup); with it off there is no cache to query: ([], 0),
        nothing counted; likewise for a request that skips_prefix_cache_reads (it asked
        for prompt logprobs). Raises ValueError unless `request` is a Request whose prompt
        fits max_model_len.
        """
        checked_request_id(request)
        check_prompt_fits(request, self.max_model_len)
        if not isinstance(count, bool):  # "no" counted, by its truthiness
            raise ValueError(f"count={count!r} must be a bool")
        hit = slot_allocation.find_cache_hit(self, request)
        if count:
            slot_allocation.count_lookup(self, request, hit.num_tokens)
        return hit.block_ids, hit.num_tokens

    def count_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Counts a lookup made with count=False once its caller acts on it (the scheduler:
        once the request is admitted); nothing with prefix caching off, or for a request
        that skips_prefix_cache_reads. Raises ValueError, counting nothing, where
        get_computed_blocks would or on a hit count outside [0, request.num_tokens]."""
        hits = checked_hit_tokens(request, num_hit_tokens)
        check_prompt_fits(request, self.max_model_len)
        if self.enable_prefix_caching and not request.skips_prefix_cache_reads:  # as gcb hashes
            request.check_hash_config(self.block_size, self.hash_seed)
        slot_allocation.count_lookup(self, request, hits)

    # ------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        *,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Gives `request` blocks for `num_new_tokens` more tokens after the cache hit.

        `new_computed_blocks` (from get_computed_blocks) are appended after the blocks the
        request already holds, covering `num_new_computed_tokens` tokens beyond
        request.num_computed_tokens. Then enough fresh blocks are taken for
        num_computed + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        tokens. Returns the fresh block ids (possibly []), or None with no state changed
        (the request's block_hashes included) if the pool cannot fit them. Every block
        that the computed plus new tokens fill is entered into the prefix cache. Computed
        tokens past the cache hit's blocks are taken as computed elsewhere, their KV
        already in the blocks they fill (which are cached at once, for other requests to
        hit): the manager cannot check that claim, so only a caller that wrote that KV may
        make it (the scheduler makes it only for KV it computed or loaded).

        Raises ValueError, with nothing changed, on a `request` that is not a Request, a
        count that is not an int >= 0 (request.num_computed_tokens included), a
        request.num_computed_tokens beyond the blocks the request holds, computed tokens
        (request.num_computed_tokens + num_new_computed_tokens) beyond the request's
        tokens, a cache hit that is not a sequence (a set or mapping has no order), does
        not start where its computed tokens end, is not covered by
        num_new_computed_tokens or no longer caches the request's tokens,
        block hashes the request computed with another block size, a prompt, or computed
        plus new plus lookahead tokens, beyond max_model_len, or a `request` whose id
        holds blocks allocated for another Request object (free that one first).
        """
        req_id = checked_request_id(request)
        num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_done = allocation_counts(
            req_id, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
            request.num_computed_tokens,
        )  # fmt: skip
        owner = self._owner.get(req_id)
        if owner is not request:  # the owner's prompt (fixed) fitted at its first call
            check_prompt_fits(request, self.max_model_len)
            if owner is not None:  # another Request object's id
                raise ValueError(not_the_owner_message(req_id))
        held = self._blocks[req_id] if owner is not None else []
        bs = self.block_size
        if num_done > len(held) * bs:  # each check: its helper raises, called on failure
            check_computed_within_held(req_id, num_done, len(held), bs)
        hash_state = request._hash_state()  # a cache hit's check hashes: a refusal rewinds
        try:
            computed = validated_computed_blocks(
                self.pool, request, len(held), num_done, num_new_computed_tokens,
                new_computed_blocks, block_size=bs, hash_seed=self.hash_seed,
            )  # fmt: skip
            # Caching the filled blocks below must not fail (hashes of another config):
            if self.enable_prefix_caching and request._hash_config != (bs, self.hash_seed):
                request.check_hash_config(bs, self.hash_seed)  # None (not hashed yet) passes
            num_computed = num_done + num_new_computed_tokens
            if num_computed > request.num_tokens:
                check_computed_within_tokens(request, num_computed)
            num_total = num_computed + num_new_tokens + num_lookahead_tokens
            if num_total > self.max_model_len:
                check_total_fits(
                    req_id, num_total, self.max_model_len, num_computed_tokens=num_computed,
                    num_new_tokens=num_new_tokens, num_lookahead_tokens=num_lookahead_tokens,
                )  # fmt: skip
        except BaseException:
            request._restore_hash_state(hash_state)
            raise
        num_new_blocks = max(0, -(-num_total // bs) - len(held) - len(computed))
        if not (num_new_blocks or computed) and owner is not None:  # commit's no-op
            slot_allocation.cache_full_blocks(self, request, num_computed + num_new_tokens)
            return []
        computed_ids = [b.block_id for b in computed]  # ints, whatever the caller passed
        new_ids = slot_allocation.commit(
            self, request, held, computed, computed_ids, num_new_blocks,
            num_computed + num_new_tokens,
        )  # fmt: skip
        if new_ids is None:  # no room: nothing changed, the request's hashes included
            request._restore_hash_state(hash_state)
        return new_ids

    def allocate_slots_batch(
        self, requests: Sequence[Request], num_new_tokens: Sequence[int]
    ) -> bool:
        """allocate_slots(r, n) for every (r, n) pair, all or nothing.

        For distinct requests that already hold blocks, without cache hits or lookahead
        (a step's running requests). Returns False with no state changed when the pool
        cannot fit them all. Fresh blocks go to the requests in order, as the calls one
        by one would hand them out; blocks the new tokens fill enter the prefix cache.
        One difference from the calls one by one: all fresh blocks are taken (evicting
        their cached hashes) before any block is cached, so a filled block whose hash
        only an evicted block carried is cached here, where one by one it would have
        stayed uncached as a duplicate. Raises ValueError (nothing changed) on a set or
        mapping (no order), a count that is not an int >= 0 (num_computed_tokens too), a
        request.num_computed_tokens beyond the request's tokens or the blocks it holds, a
        repeated request id, an unknown request or a non-Request, one that would pass
        max_model_len, or a Request whose id holds blocks allocated for another Request
        object or that holds blocks under another id (as allocate_slots). A Request hashed
        for another block size or seed is refused once it fills a block (allocate_slots
        refuses it at once; the per-step path reads no hashes before).
        """
        return batch_allocation.allocate_slots_batch(self, requests, num_new_tokens)

    def free(self, request: Request | str) -> None:
        """Releases every block of the request, tail first (so its tail is evicted first).

        Raises UnknownRequestError if the request holds no blocks (unknown or freed twice),
        ValueError if `request` is neither a str nor the Request the blocks were allocated
        for (another Request object with its id).
        """
        req_id = request_id_of("request", request, self._owner)
        blocks = self._blocks_of(req_id)
        self.pool.free_blocks(reversed(blocks), validate=False)  # the request's own
        del self._blocks[req_id]
        del self._owner[req_id]
        del self._num_cached[req_id]
        self._table.release(req_id)

    def uncache_unwritten(self, request: Request | str, num_written_tokens: int) -> None:
        """Takes the request's cached blocks past its first `num_written_tokens` tokens out
        of the prefix cache again: their KV was never written (the step that was to write
        it failed). `num_written_tokens` counts every token whose KV is in place, cache
        hits included (other requests wrote those), so only blocks this request entered
        leave the cache. A later allocation that fills them caches them anew.

        Raises UnknownRequestError if the request holds no blocks, ValueError (nothing
        changed) unless num_written_tokens is an int >= 0 and `request` a str or the
        Request the blocks were allocated for.
        """
        req_id = request_id_of("request", request, self._owner)
        num_written = count("num_written_tokens", num_written_tokens, req_id)
        self._blocks_of(req_id)  # raises UnknownRequestError if it holds none
        unwritten_blocks.uncache_unwritten(self, req_id, num_written)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block. Refused (False, nothing changed) while any is held."""
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """Cache events since the last call (empty unless enable_kv_cache_events). They
        are kept until taken, as vLLM keeps them, unbounded: untaken, they grow by about
        650 bytes for each block that enters the prefix cache (its hash and block_size
        token ids, at block_size 16) and 70 for each that leaves it. Take them often."""
        return self.pool.take_events()

    # -------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raises IntegrityError unless pool, block table and prefix ids agree.

        Requests hold the pool's own blocks, each ref count their number of holders; a row
        holds exactly its request's block ids then zeros; prefix ids are the interned chain
        of those ids; rows are owned by one request or free; each request's blocks are held
        for the Request object they were allocated for, have a count of cached leading
        blocks within them, and carry no hash but their Request's hash of their position.
        """
        check_manager_integrity(self)

    def _blocks_of(self, req_id: str) -> list[KVCacheBlock]:
        blocks = self._blocks.get(req_id)
        if blocks is None:
            raise UnknownRequestError(
                f"request {req_id!r} holds no blocks (never allocated or already freed)"
            )
        return blocks
