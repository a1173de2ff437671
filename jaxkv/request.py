"""Requests and their lifecycle states (host side, no JAX). SamplingParams lives in
jaxkv.sampling_params and is re-exported here."""

from __future__ import annotations

import enum
import operator
import time
from collections.abc import Iterable, Sequence

from jaxkv.field_checks import as_int, is_finite_number, is_unordered
from jaxkv.hashing import BlockHash, extend_block_hashes, is_hash_key
from jaxkv.request_id_lists import is_id_text, plain_id
from jaxkv.sampling_params import SamplingParams as SamplingParams  # its former home

MAX_TOKEN_ID = 2**63 - 1  # block hashes encode each token as a signed 64-bit integer


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every state from FINISHED_STOPPED on is a finished state.

    A FINISHED_TRANSFERRING request has produced its last token but its KV blocks are
    still being copied out asynchronously; it keeps its blocks until the copy lands or
    fails, then is freed and gets back the status it finished with.
    """

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # a stop token was sampled or a stop string completed
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # cancelled by the caller
    FINISHED_TRANSFERRING = enum.auto()  # finished; blocks held until an async KV copy lands

    def is_finished(self) -> bool:
        """True for every FINISHED_* state. Also callable as RequestStatus.is_finished(s)."""
        return self >= RequestStatus.FINISHED_STOPPED


def _fixed(attribute: str, doc: str) -> property:
    """A read-only attribute over the slot `attribute`. Its getter is C-level
    (operator.attrgetter): these are read per request on every scheduler step, where a
    Python property function cost twice as much."""
    return property(operator.attrgetter(attribute), doc=doc)


class Request:
    """One generation request: its tokens, progress and prefix-cache block hashes.

    `num_computed_tokens` is advanced by the caller (the scheduler) after each step.
    `block_hashes` holds the hashes of the full blocks of `all_token_ids` hashed so far,
    whether or not their KV is computed yet (a prompt's are hashed at its first
    prefix-cache lookup); update_block_hashes extends it to every full block, which the
    KVCacheManager calls when it looks the request up or allocates its slots, so it may
    lag behind tokens appended since.

    `request_id`, `prompt_token_ids`, `sampling_params`, `cache_salt` and `adapter_id`
    are fixed at construction: assigning any of them raises AttributeError. The
    KVCacheManager keys a request's blocks, and a scheduler the request, by its id; a new
    id is a new Request; a str subclass is stored as the exact str it holds
    (jaxkv.request_id_lists.plain_id). The salt and the adapter id are hashed into
    `block_hashes`: hashes already computed would keep the old ones (a cache hit of one
    adapter's KV for a request run under another), and an invalid one would fail the
    hashing of a block the manager has already handed out. The sampling params are
    checked, and their penalties and bans registered with the sampler, when the request
    is taken.
    """

    # Slots: a misspelt field assignment fails instead of adding a silent attribute.
    __slots__ = (
        "_request_id",
        "_prompt_token_ids",
        "_sampling_params",
        "_cache_salt",
        "_adapter_id",
        "arrival_time",
        "status",
        "output_token_ids",
        "num_computed_tokens",
        "num_preemptions",
        "_block_hashes",
        "queued",
        "decoded_text",
        "_all_token_ids",
        "_hash_config",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not is_id_text(request_id) or not request_id:
            raise ValueError(f"{request_id=} must be a non-empty str encodable as UTF-8")
        for name, key in (("cache_salt", cache_salt), ("adapter_id", adapter_id)):
            if key is not None and not is_hash_key(key):  # hashed as UTF-8 text
                raise ValueError(
                    f"{name}={key!r} of {request_id!r} must be None or a str encodable as UTF-8"
                )
        prompt = _token_ids("prompt_token_ids", prompt_token_ids, request_id)
        if not prompt:
            raise ValueError(f"prompt_token_ids of {request_id!r} must not be empty")
        if sampling_params is None:
            sampling_params = SamplingParams()
        elif not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"sampling_params={sampling_params!r} of {request_id!r} must be None or "
                "a SamplingParams"
            )
        if arrival_time is not None and not is_finite_number(arrival_time):
            raise ValueError(f"{arrival_time=} of {request_id!r} must be None or a finite number")
        self._request_id = plain_id(request_id)
        self._prompt_token_ids: tuple[int, ...] = tuple(prompt)
        self._sampling_params = sampling_params
        self._cache_salt = cache_salt
        self._adapter_id = adapter_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self._block_hashes: list[BlockHash] = []
        self.queued = False  # set by the Scheduler that takes it: one serves it, once
        self.decoded_text = None  # output text read so far (jaxkv.stop_strings.DecodedText)
        self._all_token_ids: list[int] = prompt
        self._hash_config: tuple[int, int] | None = None  # (block_size, seed) of block_hashes

    request_id = _fixed(
        "_request_id",
        "The request's id, fixed at construction: assigning one raises AttributeError "
        "(the manager holds its blocks, the scheduler the request, under it).",
    )
    sampling_params = _fixed(
        "_sampling_params",
        "The SamplingParams, fixed at construction: assigning others raises AttributeError "
        "(they were checked, and the sampler's state built from them, when it was taken).",
    )
    cache_salt = _fixed(
        "_cache_salt",
        "The cache salt (None or a str), hashed into the first block; fixed at "
        "construction: assigning one raises AttributeError.",
    )
    adapter_id = _fixed(
        "_adapter_id",
        "The adapter id (None or a str), hashed into every block; fixed at "
        "construction: assigning one raises AttributeError.",
    )
    block_hashes = _fixed(
        "_block_hashes",
        "Hashes of the full blocks hashed so far (a live list; do not mutate it). "
        "Assigning a list raises AttributeError: the manager caches the request's blocks "
        "under these hashes, so another prompt's hashes put its KV under that prompt.",
    )

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt, fixed at construction: assigning another raises AttributeError (the
        tokens the KV is computed and cached from would stay the old ones; a new prompt is
        a new Request)."""
        return self._prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt then output tokens: the request's own list, not a copy (it grows with
        append_output_token_ids); do not mutate it."""
        return self._all_token_ids

    @property
    def skips_prefix_cache_reads(self) -> bool:
        """True while the request must compute its prompt itself: it asked for prompt
        logprobs and has no output yet (a cache hit's positions would have no logits)."""
        return self._sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def max_tokens(self) -> int | None:
        """SamplingParams.max_tokens: None for no limit but max_model_len."""
        return self._sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Appends sampled tokens. Block hashes are extended lazily by the manager.

        Takes one token (an int or numpy integer) or an iterable of them, each in
        [0, 2**63); raises ValueError otherwise, appending nothing.
        """
        # One token per step: skip the list.
        if type(token_ids) is int and 0 <= token_ids <= MAX_TOKEN_ID:
            self.output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
            return
        if not hasattr(token_ids, "__iter__"):  # one token (an int or numpy integer)
            token_ids = (token_ids,)
        new = _token_ids("token_ids", token_ids, self.request_id)
        self.output_token_ids.extend(new)
        self._all_token_ids.extend(new)

    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def waiting_status(self) -> RequestStatus:
        """The status it waits in the queue under, back from a discard or an ended load
        (landed too): PREEMPTED once it has been preempted (num_preemptions), else WAITING."""
        return RequestStatus.PREEMPTED if self.num_preemptions else RequestStatus.WAITING

    def check_hash_config(self, block_size: int, seed: int = 0) -> None:
        """Raises ValueError if `block_hashes` were computed with another block size or seed,
        or unless `block_size` is an int >= 1 and `seed` an int that fits in 64 bits.

        Changes nothing: a caller checks this before changing its own state, so that a
        later update_block_hashes with the same arguments cannot fail.
        """
        self._checked_hash_config(block_size, seed)

    def _checked_hash_config(self, block_size: int, seed: int) -> tuple[int, int]:
        if type(block_size) is int and type(seed) is int and block_size >= 1:
            config = (block_size, seed)  # the common case, without a call per argument
        else:
            config = (as_int(block_size), as_int(seed))
            if config[0] is None or config[0] < 1:
                raise ValueError(f"{block_size=} must be an int >= 1")
        if config[1] is None or not -(2**63) <= config[1] < 2**63:
            raise ValueError(f"{seed=} must be an int that fits in 64 bits")
        if self._hash_config is not None and self._hash_config != config:
            raise ValueError(
                f"block hashes of {self.request_id!r} were computed with (block_size, seed)="
                f"{self._hash_config}, not {config}"
            )
        return config

    def update_block_hashes(self, block_size: int, seed: int = 0) -> list[BlockHash]:
        """Extends `block_hashes` to cover every full block of `all_token_ids`.

        Raises ValueError, changing nothing, where check_hash_config would.
        """
        self._hash_config = config = self._checked_hash_config(block_size, seed)
        block_size = config[0]
        if len(self._all_token_ids) // block_size > len(self._block_hashes):
            extend_block_hashes(
                self._block_hashes,
                self._all_token_ids,
                block_size,
                seed=config[1],
                adapter_id=self.adapter_id,
                cache_salt=self.cache_salt,
                tokens_checked=True,  # no bools: _token_ids refused them
            )
        return self._block_hashes

    def _hash_state(self) -> tuple[int, tuple[int, int] | None]:
        """What update_block_hashes may change, for _restore_hash_state."""
        return len(self._block_hashes), self._hash_config

    def _restore_hash_state(self, state: tuple[int, tuple[int, int] | None]) -> None:
        """Undoes the update_block_hashes calls since `state` (from _hash_state) was read:
        for a caller that refuses a call after hashing (KVCacheManager.allocate_slots)."""
        del self._block_hashes[state[0] :]
        self._hash_config = state[1]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )


def _token_ids(name: str, token_ids: Iterable[int], request_id: str) -> list[int]:
    """`token_ids` as a list of Python ints (numpy integers included), each in
    [0, MAX_TOKEN_ID]. Text (str, bytes), bools, and mappings and sets (no order; a
    dict's keys) are not token ids."""
    try:
        if isinstance(token_ids, (str, bytes, bytearray)) or is_unordered(token_ids):
            raise TypeError
        items = list(token_ids)
        if bool in set(map(type, items)):  # operator.index(True) is 1
            raise TypeError
        ids = list(map(operator.index, items))
    except TypeError:
        raise ValueError(f"{name} of {request_id!r} must be ints >= 0, got {token_ids!r}") from None
    if ids and min(ids) < 0:
        raise ValueError(f"{name} of {request_id!r} must be >= 0, got {min(ids)}")
    if ids and max(ids) > MAX_TOKEN_ID:
        raise ValueError(f"{name} of {request_id!r} must be <= {MAX_TOKEN_ID}, got {max(ids)}")
    return ids
