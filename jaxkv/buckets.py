"""Bucketed padded sizes: a long serving run compiles a bounded number of programs.

Every array that enters jit is padded to a size drawn from a small fixed set of buckets
(powers of two from a minimum, capped at the maximum), so the number of distinct shapes,
and so of compiled programs, is bounded by the product of the bucket counts
(BucketConfig.max_programs states the bound).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxkv.field_checks import positive_int_fields


def pow2_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """minimum, 2*minimum, 4*minimum, ... below maximum, then maximum itself."""
    if minimum < 1 or maximum < minimum:
        raise ValueError(f"need 1 <= {minimum=} <= {maximum=}")
    sizes = []
    size = minimum
    while size < maximum:
        sizes.append(size)
        size *= 2
    sizes.append(maximum)
    return tuple(sizes)


def padded_size(buckets: Sequence[int], n: int, *, name: str = "n") -> int:
    """The smallest bucket >= n. Raises ValueError, calling n `name`, when n exceeds the
    largest bucket."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{name}={n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def pads_fewer_pages(
    page_buckets: Sequence[int] | None,  # ascending page widths metadata is padded to
    num_computed_tokens: np.ndarray,  # i[R]
    query_lens: np.ndarray,  # i[R]
    suffix_start: int | np.ndarray,  # first block of each request's suffix pass
    block_size: int,
) -> bool:
    """Whether a cascade's suffix pass pads to fewer pages than flat attention would
    (always True for page_buckets None: the cost model does not read padded pages, or
    the planner does not know the buckets)."""
    if page_buckets is None:
        return True
    context = num_computed_tokens + query_lens
    flat_pages = -(-int(context.max()) // block_size)
    if isinstance(suffix_start, int):  # every suffix pass starts at the same block
        suffix_pages = flat_pages - suffix_start
    else:
        suffix = context - suffix_start * block_size
        suffix_pages = -(-int(suffix.max()) // block_size)

    def padded(n: int) -> int:  # a width past the largest bucket counts as the largest
        return padded_size(page_buckets, min(n, page_buckets[-1]))

    return padded(suffix_pages) < padded(flat_pages)


def least_suffix_starts(
    page_buckets: Sequence[int],  # ascending page widths metadata is padded to
    num_computed_tokens: np.ndarray,  # i[R]
    query_lens: np.ndarray,  # i[R]
    block_size: int,
) -> np.ndarray | None:
    """i64[R]: the least first block of each request's suffix pass for which
    pads_fewer_pages holds (it holds exactly where every request's suffix pass starts at
    or past its entry); None where no suffix pass can pad to fewer pages than flat
    attention (flat pads to the smallest width)."""
    pages = -(-(num_computed_tokens + query_lens) // block_size)
    flat = min(int(pages.max()), page_buckets[-1])
    widest = bisect.bisect_left(page_buckets, flat)  # flat pads to page_buckets[widest]
    if widest == 0:
        return None
    return np.maximum(pages.astype(np.int64) - page_buckets[widest - 1], 0)


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    """Sizes every padded attention array is drawn from.

    max_num_tokens: tokens scheduled in one step (the token budget).
    max_num_seqs: requests scheduled in one step.
    max_pages_per_seq: blocks a request may hold (ceil(max_model_len / block_size)).
    max_cascade_groups: prefix groups one cascade level may hold.
    The minima set the smallest bucket of each axis (a minimum above its maximum gives
    that axis the one size maximum). `max_programs()` bounds the programs they compile.
    """

    max_num_tokens: int
    max_num_seqs: int
    max_pages_per_seq: int
    max_cascade_groups: int = 8
    min_num_tokens: int = 8
    min_num_seqs: int = 4
    min_pages_per_seq: int = 4

    def __post_init__(self) -> None:
        # numpy ints become plain ints
        positive_int_fields(self, *(field.name for field in dataclasses.fields(self)))
        if self.max_num_seqs > self.max_num_tokens:
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs!r} must be <= "
                f"max_num_tokens={self.max_num_tokens!r}"
            )

    @functools.cached_property
    def token_buckets(self) -> tuple[int, ...]:
        return pow2_buckets(min(self.min_num_tokens, self.max_num_tokens), self.max_num_tokens)

    @functools.cached_property
    def seq_buckets(self) -> tuple[int, ...]:
        return pow2_buckets(min(self.min_num_seqs, self.max_num_seqs), self.max_num_seqs)

    @functools.cached_property
    def page_buckets(self) -> tuple[int, ...]:
        lo = min(self.min_pages_per_seq, self.max_pages_per_seq)
        return pow2_buckets(lo, self.max_pages_per_seq)

    @functools.cached_property
    def q_len_buckets(self) -> tuple[int, ...]:
        """Bounds on the longest query of one sequence: 1 (pure decode), then token buckets."""
        return tuple(sorted({1, *self.token_buckets}))

    @functools.cached_property
    def level_seq_buckets(self) -> tuple[int, ...]:
        """Sequences of one cascade level: its groups and at most one gap before each.
        Each holds one scheduled request or more, so there are at most max_num_seqs: a
        larger max_cascade_groups padded every level (EngineConfig.pad_cascade_levels)
        to 2 * max_cascade_groups sequences, and past int64 failed inside numpy."""
        return pow2_buckets(1, min(2 * self.max_cascade_groups, self.max_num_seqs))

    def max_programs(
        self,
        q_len_buckets: Sequence[int] | None = None,
        *,
        pad_levels: bool = False,
        cascade: bool = True,
    ) -> int:
        """An upper bound on the distinct step programs these buckets can compile.

        A program is fixed by its metadata's padded shapes and static bounds
        (jaxkv.step_inputs.program_key). The main pass draws its tokens, sequences, pages
        and query bound from token_buckets, seq_buckets, page_buckets and q_len_buckets:
        M = T * S * P * Q programs. A cascade plan adds up to two levels (outermost
        "global", then "groups"), each drawing its sequences, pages and query bound from
        level_seq_buckets, page_buckets and q_len_buckets: L = LS * P * Q shapes, so at
        most M * (1 + L)**2 programs with cascade and M without. `q_len_buckets` replaces
        Q with the coarser query bounds EngineConfig.q_len_buckets applies; `pad_levels`
        (EngineConfig.pad_cascade_levels) pads every level to one sequence count (LS = 1).
        Padding to powers of two keeps each count logarithmic in its maximum, but the
        product grows fast: with min == max on an axis it contributes a factor of 1.
        """
        q = len(self.q_len_buckets if q_len_buckets is None else q_len_buckets)
        pages = len(self.page_buckets)
        main = len(self.token_buckets) * len(self.seq_buckets) * pages * q
        if not cascade:
            return main
        level = (1 if pad_levels else len(self.level_seq_buckets)) * pages * q
        return main * (1 + level) ** 2
