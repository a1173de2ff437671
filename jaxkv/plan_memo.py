"""What the cascade planner found for a batch, reused while it stays true.

A serving loop schedules the same requests step after step (decode), and the search for
groups sharing a prefix of their own asks the same questions each time: the longest
common prefix of a member set, how many members share past a column with another,
how the members that hold a column split by their prefix id there, whether any two
requests (of those not left out) share past the base column at all, and which requests
share a column with another (whether a long query's request is left out,
jaxkv.cascade_left_out). While the
manager, the batch's rows array (rows_of returns the same object for an equal id list)
and the manager's sharing_version are unchanged, every column a row holds keeps its
prefix id, and the columns it gains hold fresh blocks that no other row holds. None of
these answers can change then: a fresh block ends any prefix two rows could share at its
column, so a longer count of held blocks adds no shared column.

The plans themselves are pure functions of their arguments (the rows object among them),
so the last plan of each kind (global only, grouped) is reused whenever a step asks for
an equal one, whatever changed since. The group searches are kept as well (note_search),
with their reads of the computed tokens (jaxkv.cascade_reads): the search reuses one
where those reads answer alike for a step's tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxkv.cascade_plan import CascadePlan, global_plan, grouped_plan
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.prefix_index import longest_common_prefix_unchecked

SplitRuns = list[np.ndarray] | None  # runs of members sharing a column; None: all distinct
MAX_ANSWERS = 1024  # answers kept for one key; more start over (bounds memory, not speed)


class PlanMemo:
    """Common prefixes, splits, where no groups exist, and the last plans of one batch;
    see the module doc.

    Every answer equals what the planner would compute now: the search's answers are
    emptied whenever their key (manager, rows object, sharing_version) changes, and a
    plan is reused only for the same rows object and equal arguments.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._answers: dict[tuple, object] = {}
        # "global" / "grouped" -> (rows, arguments, plan) of the last plan of that kind
        # (one each: a batch whose plan flips between the kinds keeps both)
        self._last_plans: dict[str, tuple] = {}

    def _answers_for(self, manager: KVCacheManager, rows: np.ndarray) -> dict:
        key, version = self._key, manager.sharing_version
        if key is None or key[0] is not manager or key[1] is not rows or key[2] != version:
            # Emptied first: a Ctrl-C between the two must not leave the old batch's
            # answers under the new key, for the next step that plans this batch.
            self._answers = {}
            self._key = (manager, rows, version)
        elif len(self._answers) >= MAX_ANSWERS:
            self._answers = {}
        return self._answers

    def common_prefix(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R] the batch's rows
        num_blocks: np.ndarray,  # i32[R] blocks each row holds
        members: np.ndarray,  # indices into rows, two or more
    ) -> int:
        """Leading columns every member's row holds with the same block ids."""
        answers = self._answers_for(manager, rows)
        key = ("lcp", members.dtype.str, members.tobytes())
        end = answers.get(key)
        if end is None:
            end = answers[key] = longest_common_prefix_unchecked(
                manager.prefix_ids, num_blocks[members], rows[members]
            )
        return end

    def common_prefix_nesting(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R] the batch's rows
        num_blocks: np.ndarray,  # i32[R] blocks each row holds
        members: np.ndarray,  # indices into rows, two or more
    ) -> tuple[int, int]:
        """(common_prefix, nested_members at that column: 0 past the last column), in one
        look-up."""
        answers = self._answers_for(manager, rows)
        key = ("lcp+nested", members.dtype.str, members.tobytes())
        found = answers.get(key)
        if found is None:
            end = longest_common_prefix_unchecked(
                manager.prefix_ids, num_blocks[members], rows[members]
            )
            nested = _nested(manager, rows, members, end) if end < manager.max_blocks_per_seq else 0
            found = answers[key] = (end, nested)
        return found

    def nested_members(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R] the batch's rows
        members: np.ndarray,  # indices into rows, two or more
        column: int,  # < manager.max_blocks_per_seq
    ) -> int:
        """Members that hold the prefix id some other member holds at `column`, less one
        per such id: the most requests any groups of `members` sharing past `column` can
        save a read of (0: no two of them share past it)."""
        answers = self._answers_for(manager, rows)
        key = ("nested", column, members.dtype.str, members.tobytes())
        found = answers.get(key)
        if found is None:
            found = answers[key] = _nested(manager, rows, members, column)
        return found

    def split(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,
        eligible: np.ndarray,  # indices into rows, each row holding `column`
        column: int,
        compute: Callable[[KVCacheManager, np.ndarray, np.ndarray, int], SplitRuns],
        kind: str = "split",
    ) -> SplitRuns:
        """compute(manager, rows, eligible, column), memoised under `kind` (one for each
        compute). The runs it returns are made read-only: later steps share them."""
        answers = self._answers_for(manager, rows)
        key = (kind, column, eligible.dtype.str, eligible.tobytes())
        if key not in answers:
            runs = answers[key] = compute(manager, rows, eligible, column)
            for run in runs or ():
                run.flags.writeable = False
        runs = answers[key]
        return runs if runs is None else list(runs)

    def shares_column(self, manager: KVCacheManager, rows: np.ndarray, column: int) -> np.ndarray:
        """bool[R] (read-only): whether each batch row holds at `column` (<
        manager.max_blocks_per_seq) a prefix id another batch row holds there. A row
        gaining the column later holds a fresh block there: it shares none, as before."""
        answers = self._answers_for(manager, rows)
        key = ("shares", column)
        found = answers.get(key)
        if found is None:
            found = answers[key] = _shared_ids(manager.prefix_ids[:, column][rows])
            found.flags.writeable = False
        return found

    def shares_through(self, manager: KVCacheManager, rows: np.ndarray, column: int) -> bool:
        """Whether every batch row that shares column 0 with another batch row also
        shares `column` (< manager.max_blocks_per_seq) with one (see shares_column)."""
        answers = self._answers_for(manager, rows)
        key = ("through", column)
        found = answers.get(key)
        if found is None:
            shares = self.shares_column(manager, rows, column)
            found = answers[key] = bool((shares | ~self.shares_column(manager, rows, 0)).all())
        return found

    def no_groups_past(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,
        base: int,
        left_out: np.ndarray | None = None,  # bool[R]
    ) -> bool:
        """Whether note_no_groups(manager, rows, base, left_out) still holds (for an
        equal `left_out`)."""
        return _none_key(base, left_out) in self._answers_for(manager, rows)

    def note_no_groups(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,
        base: int,
        left_out: np.ndarray | None = None,  # bool[R] requests the search leaves out
    ) -> None:
        """Records that every request of the batch not in `left_out` (None: none) was
        eligible for a group and no two of them held the same prefix id at column
        `base`: no group of them can form past `base`."""
        self._answers_for(manager, rows)[_none_key(base, left_out)] = True

    def search(self, manager: KVCacheManager, rows: np.ndarray, key: tuple) -> tuple | None:
        """What note_search last recorded for this batch under `key`, or None (also where
        the search of its slot last recorded another key)."""
        found = self._answers_for(manager, rows).get(_search_slot(key))
        return found[1] if found is not None and found[0] == key else None

    def note_search(
        self, manager: KVCacheManager, rows: np.ndarray, key: tuple, found: tuple
    ) -> None:
        """Records `found` (a group search's reads and groups) under `key` for this
        batch, until its key changes as every answer here. One key is kept per slot
        (key[0]): a step whose arguments differ replaces its search's last one."""
        self._answers_for(manager, rows)[_search_slot(key)] = (key, found)

    def global_plan(self, rows: np.ndarray, k0: int, common: int, made_for) -> CascadePlan:
        """cascade_plan.global_plan, or the last plan it gave for equal arguments."""
        return self._reused(
            "global", rows, (k0, common, made_for),
            lambda: global_plan(rows, k0, common, made_for),
        )  # fmt: skip

    def grouped_plan(
        self, groups, rows, suffix_start, global_blocks, common, made_for
    ) -> CascadePlan:
        """cascade_plan.grouped_plan, or the last plan it gave for equal arguments."""
        key = (
            global_blocks, common, made_for, suffix_start.tobytes(),
            tuple((m.dtype.str, m.tobytes(), end) for m, end in groups),
        )  # fmt: skip
        return self._reused(
            "grouped", rows, key,
            lambda: grouped_plan(groups, rows, suffix_start, global_blocks, common, made_for),
        )  # fmt: skip

    def _reused(self, kind: str, rows: np.ndarray, key: tuple, build) -> CascadePlan:
        """The last plan of `kind` if it was made for this rows object under an equal key,
        else build()'s, which becomes the last of its kind. Its arrays are made read-only:
        later steps get the same plan, which the metadata builder does not check."""
        last = self._last_plans.get(kind)
        if last is not None and last[0] is rows and last[1] == key:
            return last[2]
        plan = build()
        for part in (plan, *plan.levels):
            for field in dataclasses.fields(part):
                value = getattr(part, field.name)
                if isinstance(value, np.ndarray):
                    value.flags.writeable = False
        self._last_plans[kind] = (rows, key, plan)
        return plan


def _search_slot(key: tuple) -> tuple:
    """The answers' key under which note_search keeps the last search of `key`'s slot."""
    return ("search", key[0])


def _none_key(base: int, left_out: np.ndarray | None) -> tuple:
    """The answers' key of "no groups past `base`" for the requests not in `left_out`."""
    return ("none", base, None if left_out is None else left_out.tobytes())


def _nested(manager: KVCacheManager, rows: np.ndarray, members: np.ndarray, column: int) -> int:
    """PlanMemo.nested_members, computed."""
    ids = manager.prefix_ids[:, column][rows[members]]  # a column is contiguous
    ids = ids[ids >= 0]
    return len(ids) - len(set(ids.tolist()))


def _shared_ids(ids: np.ndarray) -> np.ndarray:
    """bool[n]: whether each of `ids` is >= 0 and occurs more than once among them."""
    order = np.argsort(ids, kind="stable")
    equal = ids[order][1:] == ids[order][:-1]
    repeated = np.zeros(len(ids), bool)
    repeated[1:] = equal
    repeated[:-1] |= equal
    found = np.empty(len(ids), bool)
    found[order] = repeated
    return found & (ids >= 0)
