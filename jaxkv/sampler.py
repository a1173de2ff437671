"""Token sampling from one step's logits: greedy, temperature, top-k, top-p, seeded.

A pure function of arrays with static shapes (jittable, no Python branching on values),
one row per scheduled sequence. Each row's randomness comes from its own seed folded
with its stream (0: the request's own seed, 1: the engine's default for a request that
gives none) and the position of the token being sampled, so a request draws the same
random numbers whatever batch it runs in, and again after a preemption recomputes it
(its tokens are the same up to float rounding of the logits, which a near-tie can turn),
and no explicit seed replays the draws of an unseeded request. Seeds are 64-bit: a
row's key is the threefry key whose data are the seed's high and low 32-bit words
(jax.random.key of that seed under 64-bit ints; for a seed below 2**32,
jax.random.key(seed)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.batch_rows import batch_rows
from jaxkv.logprobs import top_logprobs
from jaxkv.min_tokens import StopTokenBans
from jaxkv.penalties import TokenPenalties, apply_penalties
from jaxkv.prompt_logprobs import PromptLogprobs
from jaxkv.request import Request, RequestStatus
from jaxkv.sampling_params import SamplingParams

_SEED_MASK = 2**64 - 1  # a negative seed is taken modulo 2**64
_WORD = 2**32
_MAX_TOP_K = 2**31 - 1  # any top_k >= vocab is no cut; larger ones would overflow int32


SEED_STREAM = 0  # a request's own SamplingParams.seed
DEFAULT_STREAM = 1  # the default seed of a request that gives none

SamplingRow = tuple[float, int, float, int, int]


def sampling_row(params: SamplingParams, default_seed: int) -> SamplingRow:
    """(temperature, top_k, top_p, seed, stream) of one request: its own seed in
    SEED_STREAM, else `default_seed` in DEFAULT_STREAM; the seed modulo 2**64 and top_k
    capped at 2**31 - 1."""
    if params.seed is None:
        seed, stream = default_seed, DEFAULT_STREAM
    else:
        seed, stream = params.seed, SEED_STREAM
    top_k = min(int(params.top_k), _MAX_TOP_K)
    return (float(params.temperature), top_k, float(params.top_p), seed & _SEED_MASK, stream)


def sampling_arrays(
    rows: list[SamplingRow], num_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(temperature, top_k, top_p, seeds, streams) padded to `num_rows`; padding rows are
    greedy. seeds is u32[num_rows, 2]: each seed's high and low 32-bit words."""
    table = np.array([_table_row(row) for row in rows], np.float64).reshape(len(rows), _COLUMNS)
    return _padded_arrays(table, num_rows)


def seed_words(seeds) -> np.ndarray:
    """u32[..., 2] `seeds` (ints, each taken modulo 2**64) as sample() takes them: each
    seed's high and low 32-bit words."""
    if not isinstance(seeds, np.ndarray):  # as objects: a list mixing -1 and 2**64 - 1
        seeds = np.array(seeds, dtype=object)  # would otherwise become float64
    words = [_words(int(seed)) for seed in seeds.ravel().tolist()]
    return np.array(words, np.uint32).reshape(*seeds.shape, 2)


_COLUMNS = 6  # temperature, top_k, top_p, seed's high word, its low word, stream


def _words(seed: int) -> tuple[int, int]:
    """(high, low) 32-bit words of `seed` modulo 2**64."""
    return divmod(seed & _SEED_MASK, _WORD)


def _table_row(row: SamplingRow) -> tuple[float, int, float, int, int, int]:
    """A sampling row with its 64-bit seed split into words, each exact in a float64."""
    temperature, top_k, top_p, seed, stream = row
    return temperature, top_k, top_p, *_words(seed), stream


def _padded_arrays(
    table: np.ndarray,  # f64[n, _COLUMNS] rows of _table_row, exact: every value < 2**32
    num_rows: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = len(table)
    temperature = np.zeros(num_rows, np.float32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    seeds = np.zeros((num_rows, 2), np.uint32)
    streams = np.zeros(num_rows, np.uint32)
    if n:
        temperature[:n] = table[:, 0]
        top_k[:n] = table[:, 1]
        top_p[:n] = table[:, 2]
        seeds[:n] = table[:, 3:5].astype(np.uint32)
        streams[:n] = table[:, 5].astype(np.uint32)
    return temperature, top_k, top_p, seeds, streams


_FINISHED = frozenset(s for s in RequestStatus if s.is_finished())


class SamplingRows:
    """Each queued request's sampler row (sampling_row), and the padded arrays of a batch.

    Rows live in one float64 table, a slot per queued request (freed by discard, reused
    by a later add, which writes its row first), so a batch's arrays are one gather
    rather than a conversion of Python tuples. The arrays of the previous batch are
    reused while it holds the same Request objects in the same order: a reused id is a
    new object, so it never inherits another request's parameters.
    `logprobs` maps the queued requests that asked for logprobs to their k; a batch
    with one of them samples with `logprob_width` top tokens (logprob_width()).
    `prompt_logprobs` keeps those that asked for prompt logprobs until their first output.
    `eos_token_ids` (the model's) are banned until min_tokens also for a request that
    ignores EOS (jaxkv.min_tokens).
    """

    def __init__(self, logprob_width: int = 0, eos_token_ids: tuple[int, ...] = ()) -> None:
        self._slots: dict[str, int] = {}  # request id -> its row of _table
        self._free: list[int] = []  # rows of _table no request holds
        self._table = np.zeros((0, _COLUMNS), np.float64)
        self._memo: tuple | None = None  # (requests, order bytes or None, arrays)
        self._bans = StopTokenBans(eos_token_ids)
        self._min_p: dict[str, float] = {}  # request id -> its min_p, where above 0
        self._penalties = TokenPenalties()
        self.logprobs: dict[str, int] = {}  # request id -> its SamplingParams.logprobs
        self._logprob_width = logprob_width
        self.prompt_logprobs = PromptLogprobs(logprob_width)

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, request_id: str, params: SamplingParams, default_seed: int) -> None:
        row = _table_row(sampling_row(params, default_seed))
        slot = self._slots.get(request_id)
        if slot is None:
            if not self._free:
                size = len(self._table)
                grown = max(2 * size, 64)
                self._table = np.concatenate([self._table, np.zeros((grown - size, _COLUMNS))])
                self._free = list(range(grown - 1, size - 1, -1))
            slot = self._slots[request_id] = self._free.pop()
        self._table[slot] = row
        self._bans.add(request_id, params)
        self._penalties.add(request_id, params)
        if params.min_p > 0:
            self._min_p[request_id] = params.min_p
        else:
            self._min_p.pop(request_id, None)
        self.prompt_logprobs.discard(request_id)  # a reused id asks anew (add_request)
        if params.logprobs is not None:
            self.logprobs[request_id] = params.logprobs
        else:
            self.logprobs.pop(request_id, None)

    def add_request(self, request: Request, default_seed: int) -> None:
        """add() of a queued request, which also registers it for prompt logprobs if its
        params ask (jaxkv.prompt_logprobs keeps the Request until its first output)."""
        self.add(request.request_id, request.sampling_params, default_seed)
        self.prompt_logprobs.add(request)

    def discard(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._bans.discard(request_id)
            self._penalties.discard(request_id)
            self._min_p.pop(request_id, None)
            self.prompt_logprobs.discard(request_id)
            if self.logprobs:
                self.logprobs.pop(request_id, None)

    def logprob_width(self, requests: list) -> int | None:
        """The static logprob width of a batch of `requests`: None (no logprobs computed)
        unless one of them asked for logprobs."""
        wanted = self.logprobs
        if wanted and any(r.request_id in wanted for r in requests):
            return self._logprob_width
        return None

    def discard_finished(self, requests: list) -> None:
        """Discards the rows of the requests (a step's batch) that have finished."""
        for request in requests:
            if request.status in _FINISHED:  # a set: 7x faster than is_finished() per request
                self.discard(request.request_id)

    def arrays(self, requests: list, order: np.ndarray | None, num_rows: int):
        """sampling_arrays of `requests` in batch order (`order` None: as given)."""
        order_key = None if order is None else order.tobytes()
        memo = self._memo
        if (
            memo is not None
            and memo[0] == requests  # Request compares by identity
            and memo[1] == order_key
            and memo[2][0].shape[0] == num_rows
        ):
            return memo[2]
        slot = self._slots
        slots = np.fromiter((slot[r.request_id] for r in requests), np.intp, len(requests))
        if order is not None:
            slots = slots[order]
        arrays = _padded_arrays(self._table[slots], num_rows)
        self._memo = (list(requests), order_key, arrays)
        return arrays

    def step_arrays(self, requests: list, order: np.ndarray | None, num_rows: int, positions):
        """sample()'s arguments after the logits for one batch: `arrays`, then `positions`
        (i32[num_rows] of the tokens being sampled), then the stop tokens each row may not
        sample yet (jaxkv.min_tokens; i32[num_rows, 0] when none is banned), then the
        penalty arrays (jaxkv.penalties; None when no request of the batch lists a token),
        then each row's min_p (f32[num_rows], 0 for rows without one: no program variant)."""
        banned = self._bans.array(requests, order, num_rows)
        penalties = self._penalties.arrays(requests, order, num_rows)
        min_p, wanted = np.zeros(num_rows, np.float32), self._min_p
        listed = [i for i, r in enumerate(requests) if r.request_id in wanted] if wanted else ()
        if listed:
            min_p[batch_rows(listed, order)] = [wanted[requests[i].request_id] for i in listed]
        arrays = self.arrays(requests, order, num_rows)
        return (*arrays, positions, banned, penalties, min_p)


def sample(
    logits: jax.Array,  # f32[S, vocab]
    temperature: jax.Array,  # f32[S] 0 = greedy
    top_k: jax.Array,  # i32[S] 0 = no cut
    top_p: jax.Array,  # f32[S] 1 = no cut
    seeds: jax.Array,  # u32[S, 2] each seed's high and low 32-bit words
    streams: jax.Array,  # u32[S] SEED_STREAM or DEFAULT_STREAM
    positions: jax.Array,  # i32[S] position of the token being sampled
    banned: jax.Array | None = None,  # i32[S, B] token ids a row may not sample; others ignored
    penalties: tuple | None = None,  # jaxkv.penalties.PenaltyArrays; None: no penalty
    min_p: jax.Array | None = None,  # f32[S] 0 = no cut; None: none for any row
    *,
    num_logprobs: int | None = None,  # static: None, or top tokens per row (top_logprobs)
):  # i32[S], or (i32[S], top_logprobs' five arrays) when num_logprobs is not None
    """One token per row. Greedy rows take the argmax (lowest id on ties).

    Sampled rows draw from softmax(logits / temperature) restricted to the top_k most
    likely tokens (and those tied with the k-th, as vLLM's top-k keeps them) and then to
    the smallest prefix (by probability) whose mass reaches top_p; tokens tied with the
    last kept one are kept too (vLLM keeps one of them, by its sort's order). The
    `penalties` rewrite their rows' logits first (jaxkv.penalties.apply_penalties); then
    a row's `banned` ids in [0, vocab) are removed (their logits set to -inf), as if the
    model gave them no probability; ids outside it (padding) are ignored. `min_p` cuts
    the tokens less than min_p times as likely as the most likely one (after temperature,
    before top-k and top-p, as vLLM's). A temperature below 0.01 is used as given (vLLM
    raises it to 0.01). With `num_logprobs`, also
    jaxkv.logprobs.top_logprobs of the raw logits (before penalties and the ban, as
    vLLM's raw logprobs come before its logits processors) and the sampled tokens.
    """
    vocab = logits.shape[-1]
    logits = raw = logits.astype(jnp.float32)
    if penalties is not None:
        logits = apply_penalties(logits, penalties)
    if banned is not None and banned.shape[-1]:
        rows = jnp.arange(logits.shape[0], dtype=jnp.int32)[:, None]
        in_vocab = (banned >= 0) & (banned < vocab)  # a negative id would index from the end
        logits = logits.at[rows, jnp.where(in_vocab, banned, vocab)].set(-jnp.inf, mode="drop")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # Shift the row maximum to 0 before dividing: logits / a tiny temperature would overflow
    # to inf and tie every large logit; shifted, the maximum stays 0 and the rest -> -inf.
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    shifted = jnp.where(logits == row_max, 0.0, logits - row_max)  # also for a +inf maximum
    scaled = shifted / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if min_p is not None:  # p >= min_p * p_max is scaled >= log(min_p): the maximum is 0
        scaled = jnp.where(scaled >= jnp.log(min_p)[:, None], scaled, -jnp.inf)
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    # Tokens tied with the k-th most likely are in the top k too, as vLLM's cut keeps them.
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    in_top_k = desc >= kth
    probs = jax.nn.softmax(jnp.where(in_top_k, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p >= 1 keeps everything even where the float32 cumsum reaches 1 early; the most
    # likely token is always kept, also for a top_p that is 0 in float32 (or flushed to 0).
    keep = in_top_k & (
        (mass_before < top_p[:, None])
        | (top_p[:, None] >= 1.0)
        | (jnp.arange(vocab, dtype=jnp.int32) == 0)[None, :]
    )
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1)
    masked = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)

    def draw(seed, stream, position, row):
        # The threefry key of the 64-bit seed, whatever jax's default PRNG is.
        key = jax.random.wrap_key_data(seed, impl="threefry2x32")
        key = jax.random.fold_in(jax.random.fold_in(key, stream), position)
        # "high": the default Gumbel noise stops about 20 logits below the maximum, so a
        # large vocabulary's many unlikely tokens were drawn too rarely, or never.
        return jax.random.categorical(key, row, mode="high")

    sampled = jax.vmap(draw)(seeds, streams, positions, masked).astype(jnp.int32)
    tokens = jnp.where(temperature > 0, sampled, greedy)
    if num_logprobs is None:
        return tokens
    return tokens, top_logprobs(raw, tokens, num_logprobs)
