"""ByteTokenizer: UTF-8 bytes as token ids 0..255, plus PAD, BOS and EOS."""

from __future__ import annotations

import operator

import numpy as np


class ByteTokenizer:
    """Lossless byte-level tokenizer with no vocabulary file.

    Token id b < 256 is the byte b; ids 256, 257, 258 are PAD, BOS, EOS. `decode` keeps only
    byte ids (it drops the specials and any id outside 0..255, silently) and replaces invalid
    UTF-8 (a sample cut mid-character) with U+FFFD, one per maximal invalid subsequence; it
    refuses (ValueError) ids that are not an iterable and an id that is not an integer,
    which it would otherwise truncate. `encode` refuses (ValueError) anything but a str,
    and `bos` or `eos` flags that are not bools; `encode_array` anything but a str or
    bytes; both (UnicodeEncodeError, a ValueError) a str holding lone surrogates.
    """

    pad_id = 256
    bos_id = 257
    eos_id = 258
    eos_token_id = eos_id  # Hugging Face's name, which jaxkv.detokenizer reads
    vocab_size = 259

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        if not isinstance(text, str):  # None raised AttributeError; bytes are encode_array's
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        for name, flag in (("bos", bos), ("eos", eos)):
            if not isinstance(flag, bool):  # "false" added the token, by truthiness
                raise ValueError(f"{name}={flag!r} must be a bool")
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_array(self, text: str | bytes) -> np.ndarray:  # i32[num_bytes]
        """The bytes of `text` as an int32 array (no specials); fast for whole corpora.

        `text` is a str (its UTF-8) or bytes (bytearray, memoryview, mmap: any buffer of
        single bytes, strided too); ValueError for anything else."""
        if isinstance(text, str):
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        try:
            view = memoryview(text)
        except TypeError:  # None, an int, a list: no buffer at all
            view = None
        if view is None or view.itemsize != 1:  # an int32 array was read 4 ids per id
            raise ValueError(f"text must be a str or bytes, got {type(text).__name__}")
        if not view.c_contiguous:  # a stepped slice: np.frombuffer raised BufferError
            view = view.tobytes()  # its bytes in order, as bytes(text) reads them
        return np.frombuffer(view, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: list[int] | np.ndarray) -> str:
        # A list of plain ints (what the detokenizer decodes: two windows per request and
        # step) skips the checks per id, 3x faster on a few ids. A bool's type is not int.
        if type(ids) is list and all(type(i) is int for i in ids):
            try:
                data = bytes(ids)
            except ValueError:  # a special id, or one outside 0..255: dropped
                data = bytes([v for v in ids if 0 <= v < 256])
            return data.decode("utf-8", errors="replace")
        try:
            ids = iter(ids)
        except TypeError:  # None or one int: a TypeError naming no argument
            raise ValueError(f"ids must be an iterable of token ids, got {ids!r}") from None
        values = []
        for i in ids:
            try:
                if isinstance(i, (bool, np.bool_)):
                    raise TypeError
                values.append(operator.index(i))
            except TypeError:
                raise ValueError(f"ids must be integer token ids, got {i!r}") from None
        return bytes(v for v in values if 0 <= v < 256).decode("utf-8", errors="replace")
