"""The cascade planner's group search: which requests share a prefix of their own past a
level's first column, and which of those groups the groups level keeps.

Plain Python and numpy. CascadePlanner (jaxkv.cascade) inherits it: the search reads the
planner's cost model, shapes, max_groups and memo (PlanMemo), and asks its pays().
The search reads the requests' computed tokens through a SearchReads
(jaxkv.cascade_reads): a later step of the same batch and arguments whose computed
tokens every read answers alike gets the groups found before without a search.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxkv.cascade_reads import SearchReads
from jaxkv.cascade_together import kept_groups, kept_of_nested, net_bytes
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.prefix_index import runs_at_column

__all__ = ["GroupSearch"]


class GroupSearch:
    """The group search of CascadePlanner, which sets the attributes it reads (shape,
    cost_model, enable_groups, max_groups, _merge_only_model, _memo) and pays()."""

    def _groups(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R]
        num_computed_tokens: np.ndarray,  # i[R]
        query_lens: np.ndarray,  # i[R]
        base: int,
        whole_batch_end: int = 0,
        left_out: np.ndarray | None = None,
        need: np.ndarray | None = None,
    ) -> list[tuple[np.ndarray, int]]:
        """Groups (member indices, shared block end) sharing blocks past column `base`.

        `left_out`: bool[R], the requests the search leaves out (None: none), each with
        0 in `num_computed_tokens`; where every other request is eligible and no two of
        them share past `base`, the memo records it for that `left_out`.

        `need`: i[R] or None, the least end of a group holding each request
        (buckets.least_suffix_starts): the groups kept then hold each request needing
        more than `base` wherever the candidates allow, and none ends short of a
        member's need (kept_groups).

        `whole_batch_end` > 0: every request has computed column `base` and holds the
        same block there, and the batch shares columns up to it (capped by the computed
        blocks): the first candidate is then the whole batch, without a search.

        Candidates are requests with the same prefix id at column `base`. A candidate
        whose shared blocks do not pay is split again at the first column its members
        do not all share (requests under two system prompts after a one-block header
        form two groups, not one that does not pay). A candidate that pays but that a
        member cuts short (it has computed fewer of the blocks all of them hold alike) is
        weighed against its members past that cut, at their longer end (_past_cap); one
        that pays and ends where its members diverge, while some of them share more
        blocks, is split there too. The chosen groups are the heaviest disjoint set of
        these and of the rest of a candidate's members beside the groups kept among them
        (kept_groups), in bytes saved less their merge: a request with a short prompt
        does not hide the four under a long one that it shares 5 blocks with, nor do
        those four hide the others that share only the 5 blocks, even where all of them
        together do not pay (the four's long contexts outweigh the 5 blocks in
        min_saved_fraction, the others' do not). At most 4 x max(max_groups, 4)
        candidates are examined (those nested in a paying one last), and 4 x max_groups
        groups past a cap.

        A candidate is judged as if it were a call of its own over the members' KV past
        `base` (its savings against what their suffix pass would read without it: the
        global level already reads columns before `base` once), but one call runs every
        group of the level: candidates that pay their own merge are planned beside one
        that pays the call, or where together they pay it (four system prompts under
        four requests each; see kept_groups).

        Reused: the groups of the last search of this batch with equal arguments but
        the computed tokens, where each of its reads (SearchReads.holds) answers alike
        for these, under the same max_groups (the cost model and shapes never change).
        """
        if not self.enable_groups or base >= manager.max_blocks_per_seq:
            return []
        # One slot per kind of call a plan makes (its searches past a base), so that a
        # batch keeps a few searches, not one per step where `need` changes each step.
        # The planner's cost model and shapes are fixed at its construction (so are those
        # derived from them); its max_groups is not.
        key = (
            (base, whole_batch_end, left_out is None, need is None),
            query_lens.dtype.str, query_lens.tobytes(),
            None if left_out is None else left_out.tobytes(),
            None if need is None else (need.dtype.str, need.tobytes()),
            self.max_groups,
        )  # fmt: skip
        found = self._memo.search(manager, rows, key)
        if found is not None and found[0].holds(num_computed_tokens):
            return list(found[1])
        reads = SearchReads(num_computed_tokens, manager.block_size, self.pays, self._context_limit)
        groups = self._search(
            manager, rows, reads, query_lens, base, whole_batch_end, left_out, need
        )
        for members, _ in groups:
            members.flags.writeable = False  # shared with the later steps that reuse them
        self._memo.note_search(manager, rows, key, (reads, tuple(groups)))
        return groups

    def _search(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R]
        reads: SearchReads,  # of num_computed_tokens (i[R])
        query_lens: np.ndarray,  # i[R]
        base: int,
        whole_batch_end: int,
        left_out: np.ndarray | None,
        need: np.ndarray | None,
    ) -> list[tuple[np.ndarray, int]]:
        """_groups, searched."""
        everyone = np.arange(len(rows))
        must = None if need is None else need > base
        if whole_batch_end:
            candidates = [everyone]
        else:
            searchable = len(rows) - (0 if left_out is None else int(left_out.sum()))
            candidates = self._split(manager, rows, reads, everyone, base, searchable, must)
        if candidates is None:  # every key distinct: no two requests share past the base
            self._memo.note_no_groups(manager, rows, base, left_out)
            return []
        bs = manager.block_size
        num_blocks = manager.num_blocks_of_rows(rows)
        rest = functools.partial(  # the rest of a candidate beside groups kept in it
            self._rest, reads=reads, query_lens=query_lens, base=base, block_size=bs
        )
        # (blocks saved, members, end, queries) of the groups that pay a call of their
        # own (chosen) or their own merge in a level that runs anyway (together)
        chosen, together = [], []
        unpaid = []  # candidates that pay neither: never kept, but their rest may be
        overlap = False  # whether a group in `chosen` may hold another
        # A small max_groups keeps few groups, not few candidates: the one that pays may
        # lie under a chain of runs that do not (requests leaving one block apart).
        budget, past_cap_budget = 4 * max(self.max_groups, 4), 4 * self.max_groups
        nested_later = []  # groups nested in one that pays: after the other candidates
        within = {}  # id(candidate) -> indices into `together` above it
        grouped = {}  # index into `together` -> members of the groups under it paying a call
        while (candidates or nested_later) and budget:
            if not candidates:
                candidates, nested_later = sorted(nested_later, key=len, reverse=True), []
            budget -= 1
            members = candidates.pop(0)
            above = within.get(id(members), ()) if within else ()
            if members is everyone and whole_batch_end:
                end = shared = whole_batch_end
                nested = None
            else:  # nested: members that share past `shared` (see PlanMemo.nested_members)
                shared, nested = self._memo.common_prefix_nesting(
                    manager, rows, num_blocks, members
                )
                end = reads.end(members, shared)
            queries = int(query_lens[members].sum())
            # Weighed against what the members' suffix pass reads without this group:
            # their contexts past the global level (read once already), the flat reads the
            # group shortens (SearchReads.pays).
            saved = (len(members) - 1) * (end - base)
            if reads.pays(members, (end - base) * bs, queries, base):
                group = (saved, members, end, queries)
                for k in above:  # each weighs no more than one call: less than this group
                    grouped[k] = grouped.get(k, 0) + len(members)
                found, split = [group], None
                if end < shared:  # a member that has computed fewer blocks cuts it short
                    found, weights, (members, end, shared), past_cap_budget = self._past_cap(
                        manager, rows, num_blocks, reads, query_lens, base, group, shared,
                        past_cap_budget,
                    )  # fmt: skip
                    group, nested = found[-1], None
                if end == shared < manager.max_blocks_per_seq:
                    if nested is None:
                        nested = self._memo.nested_members(manager, rows, members, end)
                    if nested and self._may_nest(nested, reads, base, end, bs, members, group):
                        split = self._split(manager, rows, reads, members, end, must=must)
                        if split:
                            nested_later += split
                            overlap = True
                if split or len(found) == 1:
                    chosen += found  # each nested in the one before: kept_groups weighs them
                    overlap = overlap or len(found) > 1
                elif len(found[0][1]) - len(group[1]) < 2 and need is None:
                    # no rest: kept_of_nested's choice without its arrays (the heaviest,
                    # the first on ties)
                    chosen.append(found[weights.index(max(weights))])
                else:
                    chosen += kept_of_nested(
                        found, weights, base, bs, self.shape, self.cost_model, rest, need
                    )
                continue
            if self._pays_own_merge(reads, members, (end - base) * bs, queries, base):
                above = (*above, len(together))
                together.append((saved, members, end, queries))
            else:
                unpaid.append((saved, members, end, queries))
            # At end == max_blocks_per_seq (a group over whole table rows) none is split:
            # no member has computed a block past the table (check_computed_held).
            split = self._split(manager, rows, reads, members, end, must=must) or []
            within.update((id(run), above) for run in split if above)
            candidates += split
            candidates.sort(key=len, reverse=True)
        # A group paying only its merge above groups that pay a call is never kept (it
        # weighs less than each), and where they leave fewer than two of its members its
        # rest (kept_groups) is no group: dropped before the groups are weighed, unless
        # it holds a request whose pages need a group (kept_groups may keep it for that).
        together = [
            g
            for k, g in enumerate(together)
            if len(g[1]) - grouped.get(k, 0) > 1 or (must is not None and must[g[1]].any())
        ]
        if unpaid and (chosen or together):  # a rest needs two members in no group found
            in_group = np.zeros(len(rows), bool)
            for group in chosen + together:
                in_group[group[1]] = True
            unpaid = [g for g in unpaid if int((~in_group[g[1]]).sum()) > 1]
        if chosen and not (together or unpaid or overlap) and len(chosen) <= self.max_groups:
            kept = [group[:3] for group in chosen]  # disjoint, each paying: all of them
        else:
            kept = kept_groups(
                chosen + together, base, bs, self.shape, self.cost_model, self.max_groups,
                rest, unpaid, need,
            )  # fmt: skip
        return [(members, end) for _, members, end in sorted(kept, key=lambda t: int(t[1][0]))]

    def _past_cap(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R]
        num_blocks: np.ndarray,  # i32[R] blocks each row holds
        reads: SearchReads,  # of num_computed_tokens (i[R])
        query_lens: np.ndarray,  # i[R]
        base: int,
        group: tuple[int, np.ndarray, int, int],  # (blocks saved, members, end, queries)
        shared: int,  # leading columns every member holds alike, past the group's end
        budget: int,
    ) -> tuple[
        list[tuple[int, np.ndarray, int, int]], list[float], tuple[np.ndarray, int, int], int
    ]:
        """`group`, which pays and is cut at the least computed blocks of a member (one
        loading or computing blocks the others share), and the groups of its members
        past each cap in turn that pay a call of their own: those that have computed the
        first column the cap leaves out, at their own (longer) shared and computed end.
        Each nests in the one before (kept_groups or kept_of_nested weighs them). At
        most `budget` of them are examined. Also returns their weights (net_bytes),
        (members, end, shared) of the last examined, and the budget less those examined
        (for the search's other candidates)."""
        bs, model, shape = manager.block_size, self.cost_model, self.shape
        found, (_, members, end, queries) = [group], group
        weights = [net_bytes(model, shape, len(members), (end - base) * bs, queries)]
        while end < shared and budget:
            past = reads.eligible(members, end)
            if len(past) < 2:
                break
            budget -= 1
            members = past
            shared = self._memo.common_prefix(manager, rows, num_blocks, members)
            end = reads.end(members, shared)
            queries = int(query_lens[members].sum())
            prefix = (end - base) * bs
            if reads.pays(members, prefix, queries, base):
                found.append(((len(members) - 1) * (end - base), members, end, queries))
                weights.append(net_bytes(model, shape, len(members), prefix, queries))
        return found, weights, (members, end, shared), budget

    def _may_nest(
        self,
        nested: int,  # PlanMemo.nested_members of `members` at the column they diverge
        reads: SearchReads,  # of num_computed_tokens (i[R])
        base: int,
        column: int,  # where `members` diverge: the end of the last group of them
        block_size: int,
        members: np.ndarray,  # requests that hold the same blocks up to where they diverge
        group: tuple[int, np.ndarray, int, int],  # (blocks saved, members, end, queries)
    ) -> bool:
        """Whether groups of `members` sharing past where they diverge may weigh more
        than `group` (of them or of more requests; kept_groups' weight), alone or beside
        the rest of `members` at `column`: at most `nested` of them save a read each,
        of at most their most computed blocks past `base`; beside that rest, each of
        their members no longer saves the read of the blocks up to `column` (the merges
        are the same), so they gain at most `nested` reads of the blocks past `column`
        less one read of those before it. (Never False for more computed blocks where it
        is True for fewer: `nested` > 0.)"""
        s, bs = self.shape, block_size
        _, kept, end, queries = group
        weight = net_bytes(self.cost_model, s, len(kept), (end - base) * bs, queries)

        def may_nest(most: int) -> bool:  # `members`' most computed blocks
            if nested * (most - column) > column - base:
                return True
            return nested * (most - base) * bs * s.kv_bytes_per_token > weight

        return reads.rising(members, may_nest)

    def _rest(
        self,
        members: np.ndarray,  # two or more requests sharing blocks up to `end`
        end: int,
        *,
        reads: SearchReads,  # of num_computed_tokens (i[R])
        query_lens: np.ndarray,  # i[R]
        base: int,
        block_size: int,
    ) -> tuple[int, np.ndarray, int, int] | None:
        """(blocks saved, members, end, queries) of `members` as a group ending at `end`
        where it pays as the search's candidates do (a call of its own, or its own merge
        in a level that runs anyway), else None."""
        queries = int(query_lens[members].sum())
        n, prefix = len(members), (end - base) * block_size
        if reads.pays(members, prefix, queries, base) or self._pays_own_merge(
            reads, members, prefix, queries, base
        ):
            return ((n - 1) * (end - base), members, end, queries)
        return None

    def _pays_own_merge(
        self, reads: SearchReads, members: np.ndarray, prefix_tokens: int, queries: int, base: int
    ) -> bool:
        """reads.pays() for a group of a level that runs anyway: its merge, not a call of
        its own."""
        model = self._merge_only_model
        return model is not None and reads.pays(members, prefix_tokens, queries, base, model)

    def _split(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R]
        reads: SearchReads,  # of num_computed_tokens (i[R])
        members: np.ndarray,  # indices into rows, sorted
        column: int,
        searchable: int | None = None,  # requests the search may group (default: all)
        must: np.ndarray | None = None,  # bool[R] requests a group must hold, if any
    ) -> list[np.ndarray] | None:
        """Runs of >= 2 `members` holding the same block prefix through `column`, the
        2 x max_groups largest first, each sorted, then the others holding a `must`
        request; None if `searchable` requests (every request of the batch the search
        may group, not only every member) were eligible and all keys differ: then no
        group exists past `column` at all."""
        # A request can share column `column` in a cascade level only once it has
        # computed that whole block (then it also holds it).
        eligible = reads.eligible(members, column)
        if len(eligible) < 2:
            return []
        runs = self._memo.split(manager, rows, eligible, column, self._split_eligible)
        if runs is None and len(eligible) < (len(rows) if searchable is None else searchable):
            return []
        if runs and must is not None and must[eligible].any():
            held = np.zeros(len(must), bool)
            for run in runs:
                held[run] = True
            if (must[eligible] & ~held[eligible]).any():  # in runs past the cap
                every = self._memo.split(manager, rows, eligible, column, _all_runs, "runs")
                runs += [run for run in every if must[run].any() and not held[run[0]]]
        return runs

    def _split_eligible(
        self, manager: KVCacheManager, rows: np.ndarray, eligible: np.ndarray, column: int
    ) -> list[np.ndarray] | None:
        """The runs of `eligible` members (two or more, each holding `column`) at
        `column` (prefix_index.runs_at_column): None where every key differs."""
        return runs_at_column(
            manager.prefix_ids, rows[eligible], eligible, column, 2 * self.max_groups
        )


def _all_runs(
    manager: KVCacheManager, rows: np.ndarray, eligible: np.ndarray, column: int
) -> list[np.ndarray] | None:
    """GroupSearch._split_eligible without its cap on the runs."""
    return runs_at_column(manager.prefix_ids, rows[eligible], eligible, column, len(eligible))
