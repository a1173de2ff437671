"""The main job's workload: chat requests under one preamble and two system prompts.

Every request starts with the same preamble (level "global" of a cascade plan), then one
of two system prompts with its few-shot block (level "groups"), then a question of its
own. Texts are ASCII, so one byte is one token of jaxkv.models.ByteTokenizer.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import numpy as np

from jaxkv.models import ByteTokenizer

# Shared by every request: level "global" of the cascade plan.
PREAMBLE = (
    "You are a reading companion for the novel Botchan by Natsume Soseki, in the 1919 "
    "translation. Answer each question about its people, places and events in one or two "
    "plain sentences, and never invent a scene that is not in the book.\n"
)
# One per group: level "groups" (a system prompt followed by its few-shot block).
SYSTEM_PROMPTS = (
    "System: speak as the narrator himself, a quick-tempered and honest young man from "
    "Tokyo who has just become a mathematics teacher in a country middle school.\n",
    "System: speak as Kiyo, the old servant who raised the narrator, gentle and proud of "
    "him, who waits in Tokyo for his letters and believes he will be a great man.\n",
)
FEW_SHOT = (
    ("Who gave the narrator three yen?", "Kiyo did, and he never paid her back."),
    ("Where does the narrator teach?", "At a middle school in a small town in Shikoku."),
    ("What does the narrator call the head teacher?", "He calls him Red Shirt."),
    ("Who is Porcupine?", "The chief mathematics teacher, a brave and honest man."),
    ("What did the students write on the blackboard?", "Four bowls of tempura, to tease."),
    ("Where does the narrator bathe?", "At the hot springs, nearly every evening."),
    ("Who is Hubbard Squash?", "A pale, gentle English teacher who is sent away."),
    ("How does the narrator leave the town?", "By steamer, and he never goes back."),
)
NAMES = ("the narrator", "Kiyo", "Red Shirt", "Porcupine", "Hubbard Squash", "the landlady")
TOPICS = (
    "the school",
    "the hot springs",
    "the tempura",
    "the night duty",
    "Tokyo",
    "the students",
    "the fishing trip",
    "Madonna",
)
QUESTIONS = (
    "What does {name} think of {topic}?",
    "What did {name} say about {topic}?",
    "Why does {name} talk about {topic}?",
    "When does {name} first see {topic}?",
)


@dataclasses.dataclass(frozen=True)
class Prompt:
    group: int  # which system prompt
    question: str
    token_ids: list[int]


def _fit(text: str, n: int) -> str:
    """`text` repeated or cut to exactly n characters (all ASCII: n byte tokens)."""
    return (text * (n // len(text) + 1))[:n]


def shared_prefixes(prefix_len: int) -> list[str]:
    """The two prefixes: one common preamble (a third), then a group's prompt and examples.

    Texts are repeated or cut to fill exactly prefix_len bytes (one token per byte).
    """
    preamble = _fit(PREAMBLE, prefix_len // 3)
    examples = "".join(f"Q: {q}\nA: {a}\n" for q, a in FEW_SHOT)
    return [preamble + _fit(s + examples, prefix_len - len(preamble)) for s in SYSTEM_PROMPTS]


def min_prefix_len() -> int:
    """The shortest prefix_len whose two group prefixes differ: below it both are the
    preamble and "System: speak as " cut short, one system prompt in two groups."""
    n = 1
    while len(set(shared_prefixes(n))) < 2:
        n += 1
    return n


def common_prefix_len(prefix_len: int) -> int:
    """Tokens every request shares: the preamble, and then the words both system prompts
    open with ("System: speak as "), so more than the preamble's third."""
    return len(os.path.commonprefix(shared_prefixes(prefix_len)))


def _questions() -> list[str]:
    return [t.format(name=n, topic=c) for t, n, c in itertools.product(QUESTIONS, NAMES, TOPICS)]


def _prompt_text(prefix: str, question: str) -> str:
    return prefix + f"Q: {question}\nA:"


def shortest_prompt_len(prefix_len: int) -> int:
    """The fewest tokens of any prompt of workload(..., prefix_len, ...), known without
    building it: the prefix and the shortest question."""
    return prefix_len + len(_prompt_text("", min(_questions(), key=len)))


def workload(num_requests: int, prefix_len: int, seed: int) -> list[Prompt]:
    """Requests alternating between the two system prompts, each with its own question."""
    tok = ByteTokenizer()
    prefixes = shared_prefixes(prefix_len)
    questions = _questions()
    rng = np.random.default_rng(seed)
    picked = rng.permutation(len(questions))
    prompts = []
    for i in range(num_requests):
        question = questions[picked[i % len(questions)]]
        if i >= len(questions):  # more requests than distinct questions: keep them distinct
            question = f"{question} ({i // len(questions) + 1})"
        group = i % 2
        text = _prompt_text(prefixes[group], question)
        prompts.append(Prompt(group, question, tok.encode(text)))
    return prompts
