"""Finished-text cases on the tiny model with its byte tokenizer, and their oracle.

The prompts are ASCII, so an output's text is its own bytes decoded as UTF-8 (with
replacement): a stop string (ASCII) cuts the bytes where it starts, a stop token leaves
its byte out, unless include_stop_str_in_output; and bytes still cutting a character at
the end (up to MAX_HELD_TOKENS of them) are left out, as vLLM's streaming detokenizer
never hands them out.
"""

from __future__ import annotations

import numpy as np

from jaxkv import SamplingParams
from jaxkv.models import ByteTokenizer
from jaxkv.stop_strings import MAX_HELD_TOKENS
from tests.engine._util import dense_greedy

MAX_TOKENS = 24
TOKENIZER = ByteTokenizer()


def byte_text(data) -> str:
    return bytes(data).decode("utf-8", errors="replace")


def streamed_text(data) -> str:
    """The text of `data` less the last bytes, at most MAX_HELD_TOKENS, whose text ends
    in U+FFFD (a character still cut)."""
    for end in range(len(data), len(data) - MAX_HELD_TOKENS, -1):
        if not byte_text(data[:end]).endswith("\ufffd"):
            return byte_text(data[:end])
    return byte_text(data[: len(data) - MAX_HELD_TOKENS])


def text_cases():
    """(prompt, greedy tokens, params, expected text): ASCII prompts, each run to length,
    to the token after its first UTF-8 lead byte as a stop token (a cut character ends its
    text), and to its first ASCII pair as a stop string and to its fourth token as a stop
    token, each with and without include_stop_str_in_output."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(ord("a"), ord("z") + 1, int(n)).tolist() for n in (3, 9, 14, 20)]
    cases = []
    for prompt, tokens in zip(prompts, dense_greedy(prompts, MAX_TOKENS), strict=True):
        cases.append((prompt, tokens, SamplingParams(max_tokens=MAX_TOKENS), streamed_text(tokens)))
        # A stop token right after a character's first byte: the text before it is cut.
        lead = next(i for i, t in enumerate(tokens) if t >= 0xC2 and i + 2 < len(tokens))
        if tokens.index(tokens[lead + 1]) == lead + 1:
            params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[tokens[lead + 1]])
            cases.append((prompt, tokens, params, streamed_text(tokens[: lead + 1])))
        pairs = [i for i in range(len(tokens) - 1) if all(32 <= t < 127 for t in tokens[i : i + 2])]
        if pairs and tokens.index(tokens[pairs[0]]) == pairs[0]:
            at = pairs[0]
            stop = byte_text(tokens[at : at + 2])
            if byte_text(tokens).find(stop) == len(byte_text(tokens[:at])):  # first in the text too
                for include in (False, True):
                    params = SamplingParams(
                        max_tokens=MAX_TOKENS, stop=stop, include_stop_str_in_output=include
                    )
                    cases.append((prompt, tokens, params, byte_text(tokens[: at + 2 * include])))
        first = tokens.index(tokens[3])
        for include in (False, True):
            params = SamplingParams(
                max_tokens=MAX_TOKENS,
                stop_token_ids=[tokens[3]],
                include_stop_str_in_output=include,
            )
            cases.append((prompt, tokens, params, streamed_text(tokens[: first + include])))
    assert sum(bool(p.stop) for _, _, p, _ in cases) >= 4, "too few ASCII pairs: pick a new seed"
    held_back = [c for c in cases if c[2].stop_token_ids and c[3] + "\ufffd" in byte_text(c[1])]
    assert len(held_back) >= 2, "too few cut characters before a stop token: pick a new seed"
    return cases
