"""A Ctrl-C at any line of KVCacheManager.reset_prefix_cache (Engine.reset_prefix_cache):
the prefix cache is emptied whole or left whole, and no block handed out later is found
under a hash of the KV it held before."""

from __future__ import annotations

from jaxkv import KVCacheManager, Request
from tests.host._line_interrupts import LineInterrupts

PROMPT = list(range(1, 30))  # 7 full blocks of 4


def _cached_and_free() -> KVCacheManager:
    """A manager whose free blocks hold PROMPT's 7 cached full blocks."""
    m = KVCacheManager(16, 4, max_model_len=64)
    a = Request("a", PROMPT)
    assert m.allocate_slots(a, len(PROMPT)) is not None
    a.num_computed_tokens = len(PROMPT)
    m.allocate_slots(a, 0)  # caches its full blocks
    m.free(a)
    return m


def test_a_ctrl_c_at_any_line_of_reset_prefix_cache_leaves_the_cache_whole():
    # Cut midway, reset cleared some blocks' hashes but left them in the hash map: a
    # block handed out later kept its map entry, and a prompt with the old tokens hit
    # that block, now holding another request's KV.
    at = 0
    while True:
        at += 1
        m = _cached_and_free()
        lines = LineInterrupts(at)
        try:
            with lines:
                m.reset_prefix_cache()
        except KeyboardInterrupt:
            pass
        if lines.fired is None:
            break
        m.check_integrity()
        _, num_hit = m.get_computed_blocks(Request("c", PROMPT))
        assert num_hit in (0, 28), lines.fired[:2]
        other = Request("b", list(range(100, 160)))
        assert m.allocate_slots(other, 60) is not None  # every block, each evicted
        m.check_integrity()
        _, num_hit = m.get_computed_blocks(Request("c", PROMPT))
        assert num_hit == 0, lines.fired[:2]
    assert at > 5  # reset's code was tried throughout
