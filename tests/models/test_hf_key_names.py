"""LlamaConfig's errors about a Hugging Face config name config.json's keys: its field
names are renamed to the keys, and only they. A value that happens to spell a field
name (in quotes, as the message gives it) is quoted back exactly as config.json holds it."""

from __future__ import annotations

import re

import pytest

from jaxkv.models import LlamaConfig

REQUIRED = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
)
KV = "(LlamaConfig says num_kv_heads for num_key_value_heads)"
EOS = "(LlamaConfig says eos_token_ids for eos_token_id)"


INT = f"must be an int {KV}"
IDS = f"must be token ids in [0, vocab_size=64) {EOS}"


@pytest.mark.parametrize(
    "key, value, rest",
    [
        ("num_key_value_heads", "num_layers", INT),
        ("num_key_value_heads", "self.num_heads", INT),
        ("num_key_value_heads", "num_layers's", INT),  # repr in double quotes
        ("num_key_value_heads", "a'\"num_heads", INT),  # an escaped quote inside
        ("eos_token_id", ["num_heads"], IDS),
        ("eos_token_id", {"num_layers": 1}, IDS),
        ("hidden_size", "num_kv_heads", "must be an int"),
    ],
    ids=["word", "self-dot", "double-quoted", "escaped-quote", "in-list", "dict-key", "key"],
)
def test_a_value_that_spells_a_field_name_is_quoted_as_given(key, value, rest):
    # The value was renamed too (num_key_value_heads='num_hidden_layers'), quoting
    # config.json as holding what it does not, and its "renaming" was explained.
    with pytest.raises(ValueError) as info:
        LlamaConfig.from_hf_dict({**REQUIRED, key: value})
    assert str(info.value) == f"Hugging Face config: {key}={value!r} {rest}"


def test_field_names_outside_quotes_are_still_renamed():
    with pytest.raises(ValueError, match=re.escape(
        "num_attention_heads=4 must be a multiple of num_key_value_heads=3 (grouped-query) "
        "(LlamaConfig says num_heads for num_attention_heads, num_kv_heads for num_key_value_heads)"
    )):  # fmt: skip
        LlamaConfig.from_hf_dict({**REQUIRED, "num_key_value_heads": 3})
