"""Each token's own text, for Logprob.decoded_token (sample and prompt logprobs).

As vLLM's LogprobsProcessor reads it: the token decoded alone, `tokenizer.decode([id])`
with the decode's default arguments (a Hugging Face tokenizer keeps special tokens
there, whatever SamplingParams.skip_special_tokens says about the output text), and ""
where the decode returns None. A byte of a multi-byte character decodes alone to
U+FFFD, as in vLLM.
"""

from __future__ import annotations

import logging

import numpy as np

__all__ = ["TokenTexts"]

logger = logging.getLogger(__name__)


class TokenTexts(dict):
    """token id -> its text, decoded on the first read of each id and kept: at most one
    entry per id of the vocabulary, so a step's cost is a dict lookup per logprob entry.

    A decode that raises or returns neither a str nor None gives None for that id, logged
    once (logger "jaxkv.token_texts"); as with the output text (jaxkv.detokenizer), a
    failing tokenizer must not stop the step halfway through handing out its outputs.
    """

    def texts_of(self, token_ids) -> dict[int, str | None]:
        """A plain dict of the texts of `token_ids` (any int array): what an output keeps,
        so that it holds neither the tokenizer nor this cache."""
        return {t: self[t] for t in np.unique(np.asarray(token_ids)).tolist()}

    __slots__ = ("_decode",)

    def __init__(self, decode) -> None:
        super().__init__()
        self._decode = decode

    def __missing__(self, token_id: int) -> str | None:
        try:
            text = self._decode([token_id])
        except Exception as e:  # noqa: BLE001 - logged; the step goes on
            logger.error("tokenizer.decode([%d]) raised %r: decoded_token is None", token_id, e)
            text = None
        else:
            if text is None:
                text = ""
            elif not isinstance(text, str):
                logger.error(
                    "tokenizer.decode([%d]) returned %r, not a str: decoded_token is None",
                    token_id, text,
                )  # fmt: skip
                text = None
        self[token_id] = text
        return text
