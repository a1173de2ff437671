"""A cascade plan: how one scheduled batch runs attention (flat, or levels of shared blocks).

Plain numpy, no JAX. CascadePlanner (jaxkv.cascade) makes plans; the metadata builder
(jaxkv.batch) turns them into padded device arrays. Both classes check their own
consistency on construction, so a hand-made plan that the builder would misread is
refused with a ValueError.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxkv.field_checks import as_int

__all__ = ["CascadeLevel", "CascadePlan", "grouped_plan", "make_level"]


@dataclasses.dataclass(frozen=True)
class CascadeLevel:
    """One non-causal pass: group g (batch positions group_starts[g]:group_ends[g]) attends
    to block columns block_starts[g]:block_ends[g] of the row leader_rows[g]."""

    name: str  # "global" or "groups"
    group_starts: np.ndarray  # i32[G] first batch position of each group
    group_ends: np.ndarray  # i32[G] one past the last batch position
    block_starts: np.ndarray  # i32[G] first shared block column
    block_ends: np.ndarray  # i32[G] one past the last shared block column
    leader_rows: np.ndarray  # i32[G] a block-table row holding the group's shared blocks

    def __post_init__(self) -> None:
        """Raises ValueError unless the five arrays are 1-D integer numpy arrays of one
        length, there is a group, the groups are non-empty, in batch order and disjoint,
        each over a non-empty range of block columns of a block-table row >= 0 (the
        metadata builder relies on it: numpy would read row -1 as the table's last row).
        Unsigned arrays are kept as int64 (their sums with signed counts are floats)."""
        names = ("group_starts", "group_ends", "block_starts", "block_ends", "leader_rows")
        _sign_fields(self, names)
        fields = [getattr(self, name) for name in names]
        if not all(_is_int_vector(f) for f in fields) or len({f.shape for f in fields}) != 1:
            raise ValueError(
                f"level {self.name!r}: its five arrays must be 1-D integer numpy arrays "
                "of one length"
            )
        if not self.group_starts.size:  # a pass over no sequence: nothing to plan
            raise ValueError(f"level {self.name!r} must have at least one group")
        if self.leader_rows.size and self.leader_rows.min() < 0:
            raise ValueError(
                f"level {self.name!r}: leader_rows {self.leader_rows.tolist()} must be "
                "block-table rows (>= 0)"
            )
        starts, ends = self.group_starts.tolist(), self.group_ends.tolist()
        previous_end = 0
        for g, (start, end, b0, b1) in enumerate(
            zip(starts, ends, self.block_starts.tolist(), self.block_ends.tolist(), strict=True)
        ):
            if not previous_end <= start < end or not 0 <= b0 < b1:
                raise ValueError(
                    f"level {self.name!r} group {g}: batch positions {start}:{end} and "
                    f"blocks {b0}:{b1} must be non-empty, with groups in batch order from "
                    f"position {previous_end} on"
                )
            previous_end = end

    @property
    def num_groups(self) -> int:
        return len(self.group_starts)


@dataclasses.dataclass(frozen=True)
class CascadePlan:
    """How one scheduled batch runs attention. Valid until its manager next frees a request
    (the metadata builder refuses a plan made by CascadePlanner after that).

    order[i] is the index (into the scheduled list given to plan()) of the request at
    batch position i; the batch must be laid out in this order. suffix_start_blocks[i] is
    the first block column the causal suffix pass of position i reads (0 everywhere for a
    flat plan). Levels run non-causally over the shared blocks and merge by LSE.
    """

    order: np.ndarray  # i32[R] batch position -> scheduled index
    rows: np.ndarray  # i32[R] block-table row of each batch position
    suffix_start_blocks: np.ndarray  # i32[R] per batch position
    levels: tuple[CascadeLevel, ...]
    num_common_prefix_blocks: int  # exact common prefix of the whole batch, before capping
    keeps_order: bool = False  # True only if order is the identity (schedule order)
    # (manager, its row_version) for CascadePlanner's plans: the metadata builder refuses
    # the plan once that manager has freed a request, whose row may then hold another's.
    made_for: tuple[Any, int] | None = dataclasses.field(default=None, repr=False, compare=False)
    # The metadata builder's memo of the level metadata it last built for this plan (see
    # jaxkv.level_metadata); empty until then.
    level_memo: list = dataclasses.field(
        default_factory=list, init=False, repr=False, compare=False
    )
    # False only for plans correct by construction (CascadePlanner's, whose tests run
    # check() on them): check() costs O(R) numpy work, every step.
    validate: dataclasses.InitVar[bool] = True
    # not validate: the metadata builder skips its check that each group member holds
    # the blocks its level reads. A plan made otherwise (dataclasses.replace of a
    # planner's plan too, which keeps made_for) is checked.
    by_planner: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self, validate: bool) -> None:
        """A hand-made plan (validate) is checked (see check), after its levels, common
        prefix and keeps_order are: ValueError naming the field unless a tuple (or list,
        kept as a tuple) of CascadeLevel, an int >= 0 and a bool."""
        object.__setattr__(self, "by_planner", not validate)
        if validate:  # a hand-made plan: unsigned arrays kept as int64, as levels keep them
            _sign_fields(self, ("order", "rows", "suffix_start_blocks"))
            _check_plain_fields(self)
            self.check()

    def check(self) -> None:
        """Raises ValueError unless order, rows and suffix starts are 1-D integer numpy
        arrays, one per request, order is a permutation (the identity if keeps_order),
        rows are distinct (a row twice would write its KV slots twice) and >= 0, every
        level's groups lie within the batch, and each batch position's block columns are
        read exactly once: the levels that cover it (in level order) read consecutive
        ranges from column 0, and its suffix pass starts where the last of them ends.

        Not checked (a plan holds no block table): that each group's requests hold its
        leader row's blocks in the level's columns; build_attention_metadata checks that
        for a hand-made plan. Cost: O(R) numpy work per level, and a sort of the rows.
        """
        if not all(_is_int_vector(a) for a in (self.order, self.rows, self.suffix_start_blocks)):
            raise ValueError("order, rows and suffix_start_blocks must be 1-D integer numpy arrays")
        num_requests = len(self.order)
        if len(self.rows) != num_requests or len(self.suffix_start_blocks) != num_requests:
            raise ValueError(
                f"{len(self.order)=}, {len(self.rows)=} and {len(self.suffix_start_blocks)=} "
                "must be equal (one per scheduled request)"
            )
        if not _is_permutation(self.order):
            raise ValueError(f"order {self.order.tolist()} must be a permutation of the batch")
        if self.keeps_order and (self.order != np.arange(num_requests)).any():
            raise ValueError(
                f"keeps_order=True needs the identity order, not {self.order.tolist()}"
            )
        if num_requests and self.rows.min() < 0:
            raise ValueError(f"rows {self.rows.tolist()} must be block-table rows (>= 0)")
        if num_requests > 1 and _has_repeat(self.rows):
            raise ValueError(f"rows {self.rows.tolist()} must be distinct (one per request)")
        covered_to = np.zeros(num_requests, np.int64)  # block columns the levels read so far
        for level in self.levels:
            if level.num_groups and int(level.group_ends[-1]) > num_requests:
                raise ValueError(
                    f"level {level.name!r}: group_ends {level.group_ends.tolist()} must "
                    f"stay within the {num_requests} requests of the batch"
                )
            group, pos = positions_of_groups(level)
            if (covered_to[pos] != level.block_starts[group]).any():
                raise ValueError(
                    f"level {level.name!r}: block_starts {level.block_starts.tolist()} must "
                    "start where the earlier levels end for each of its batch positions"
                )
            covered_to[pos] = level.block_ends[group]
        if (covered_to != self.suffix_start_blocks).any():
            raise ValueError(
                f"suffix_start_blocks {self.suffix_start_blocks.tolist()} must be where the "
                f"levels' block columns end at each batch position ({covered_to.tolist()})"
            )

    @property
    def uses_cascade(self) -> bool:
        return bool(self.levels)

    @property
    def num_levels(self) -> int:
        return len(self.levels)


def _check_plain_fields(plan: CascadePlan) -> None:
    """ValueError naming the field unless `plan.levels` is a tuple or list of CascadeLevel
    (stored as a tuple), num_common_prefix_blocks an int >= 0 (stored as an int) and
    keeps_order a bool: check() read a level of another kind by its attributes, and the
    builder reads keeps_order by its truthiness."""
    levels = plan.levels
    if not isinstance(levels, (tuple, list)) or not all(
        isinstance(level, CascadeLevel) for level in levels
    ):
        raise ValueError(f"levels={levels!r} must be a tuple of CascadeLevel")
    object.__setattr__(plan, "levels", tuple(levels))
    common = as_int(plan.num_common_prefix_blocks)
    if common is None or common < 0:
        raise ValueError(
            f"num_common_prefix_blocks={plan.num_common_prefix_blocks!r} must be an int >= 0"
        )
    object.__setattr__(plan, "num_common_prefix_blocks", common)
    if not isinstance(plan.keeps_order, (bool, np.bool_)):
        raise ValueError(f"keeps_order={plan.keeps_order!r} must be a bool")
    object.__setattr__(plan, "keeps_order", bool(plan.keeps_order))


def _is_int_vector(a) -> bool:
    return isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.kind in "iu"


def _sign_fields(owner, names: tuple[str, ...]) -> None:
    """Stores each unsigned integer array among `names` of a frozen `owner` as int64."""
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "u":
            object.__setattr__(owner, name, value.astype(np.int64))


def _has_repeat(values: np.ndarray) -> bool:
    """Whether an entry of `values` occurs twice (sorted: np.bincount would allocate an
    array as long as the largest entry, 2**40 for a hand-made row id of that size)."""
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def _is_permutation(order: np.ndarray) -> bool:
    n = len(order)
    if n == 0:
        return True
    if order.min() < 0 or order.max() >= n:
        return False
    seen = np.zeros(n, bool)
    seen[order] = True
    return bool(seen.all())


def positions_of_groups(level: CascadeLevel) -> tuple[np.ndarray, np.ndarray]:
    """(group, batch position) of every position a group of `level` covers."""
    sizes = level.group_ends - level.group_starts
    group = np.repeat(np.arange(level.num_groups), sizes)
    first_index = np.cumsum(sizes) - sizes  # index in `group` of each group's first position
    pos = np.arange(len(group)) + (level.group_starts - first_index)[group]
    return group, pos


def make_level(name, starts, ends, block_starts, block_ends, leaders) -> CascadeLevel:
    """A CascadeLevel from per-group sequences of ints (checked as CascadeLevel checks)."""
    fields = np.array([starts, ends, block_starts, block_ends, leaders], np.int32)
    return CascadeLevel(name, *fields)


def global_plan(rows: np.ndarray, k0: int, common: int, made_for) -> CascadePlan:
    """The plan with one "global" level, the first k0 blocks of the whole batch, in batch
    order (rows: i32[R] block-table rows)."""
    num_requests = len(rows)
    identity = np.arange(num_requests, dtype=np.int32)
    suffix_start = np.full(num_requests, k0, np.int32)
    level = make_level("global", [0], [num_requests], [0], [k0], [rows[0]])
    return CascadePlan(
        identity, rows, suffix_start, (level,), common, keeps_order=True, made_for=made_for,
        validate=False,
    )  # fmt: skip


def grouped_plan(
    groups: list[tuple[np.ndarray, int]],  # (batch positions, end block) per group
    rows: np.ndarray,  # i32[R] block-table rows, batch order
    suffix_start: np.ndarray,  # i32[R] first block of each request's own pass, batch order
    global_blocks: int | None,  # blocks of a global level under the groups; None: none
    common: int,
    made_for,
) -> CascadePlan:
    """The plan with a "groups" level (over a "global" one if global_blocks): grouped
    requests first, each group's members together, then the rest in batch order."""
    num_requests = len(rows)
    grouped = np.concatenate([members for members, _ in groups])
    ungrouped = np.ones(num_requests, bool)
    ungrouped[grouped] = False
    order = np.concatenate([grouped, np.flatnonzero(ungrouped)]).astype(np.int32)
    levels = []
    if global_blocks is not None:
        levels.append(
            make_level("global", [0], [num_requests], [0], [global_blocks], [rows[order[0]]])
        )
    starts, ends, block_ends, leaders = [], [], [], []
    for members, end in groups:
        first = ends[-1] if ends else 0
        starts.append(first)
        ends.append(first + len(members))
        block_ends.append(end)
        leaders.append(rows[members[0]])
    base = global_blocks or 0
    levels.append(make_level("groups", starts, ends, [base] * len(groups), block_ends, leaders))
    return CascadePlan(
        order, rows[order], suffix_start[order], tuple(levels), common, made_for=made_for,
        validate=False,
    )  # fmt: skip
