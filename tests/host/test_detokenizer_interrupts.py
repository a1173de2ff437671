"""A Ctrl-C at any line of the detokenizer's own code, during the update of streaming
requests with stop strings: the detokenizer hands out each character once and finds each
stop string, as in an uninterrupted run. Only the tokenizer's decode (user code) is
stopped at once; the detokenizer's bookkeeping is done whole, the interrupt raised once
the update is done.

An interrupted update loses its step's outputs (Scheduler.update_from_output), so what
the detokenizer handed out is read from its calls (read's streamed text, text's
finishing part), as the update would have put them in the outputs."""

from __future__ import annotations

from jaxkv import RequestStatus, SamplingParams
from jaxkv.detokenizer import Detokenizer
from jaxkv.held_interrupts import UserCode
from jaxkv.models import ByteTokenizer
from jaxkv.request import Request
from tests.host._line_interrupts import LineInterrupts, fired_in, raised_at_once
from tests.host._sched_util import add, make_scheduler

PAD, EOS = ByteTokenizer.pad_id, ByteTokenizer.eos_id
FILES = {"detokenizer.py", "stop_strings.py"}
# Lines that call the tokenizer, and the line after each (where a tracer, unlike a
# signal, can run before the flag is reset): a Ctrl-C there stops it at once.
USER_CALLS = ("decode(", "user_code.runs = False")

# request id -> (output tokens fed in order, sampling params); prompts are b"Q: ".
CASES = {
    # a stop string spanning tokens, streamed text held back as it may begin one
    "a": (list("h\u00e9 STOP x".encode()), {"stop": ["STOP"], "max_tokens": 20}),
    # a stop string that ends in a character cut between tokens, kept in the output
    "b": (
        list("ab\u20ac!c".encode()),
        {"stop": ["\u20ac!", "zz"], "include_stop_str_in_output": True, "max_tokens": 20},
    ),
    # a 4-byte character with PAD between its bytes; ends by length on a cut character
    "c": (
        [0x61, 0xF0, PAD, 0x9F, 0x98, 0x80, 0x62, 0xE2, 0x82],
        {"stop": ["b\u20ac"], "max_tokens": 9},
    ),
    # min_tokens: the text of the first tokens may begin a string, not end one
    "d": (list(b"xyxyxy"), {"stop": ["xy"], "min_tokens": 2, "max_tokens": 20}),
    # ends by its stop token (EOS), a stop string not found
    "e": ([*b"ok \xc3\xa9", EOS], {"stop": ["k!"], "stop_token_ids": [EOS], "max_tokens": 20}),
}
EXPECTED = {"a": "h\u00e9 ", "b": "ab\u20ac!", "c": "a\U0001f600b", "d": "xy", "e": "ok \u00e9"}


def _token_of(request) -> int:
    """The request's next output token: its case's, then "." (a missed stop string runs on
    to max_tokens)."""
    feed, i = CASES[request.request_id][0], len(request.output_token_ids)
    return feed[i] if i < len(feed) else ord(".")


class _Recording(Detokenizer):
    """Records what each read() and text() hands out: a request's streamed texts, its
    finishing output's part replacing its last read's (which that part includes)."""

    def __init__(self) -> None:
        super().__init__(ByteTokenizer())
        self.parts: dict[str, list[str | None]] = {}
        self.stop_reasons: dict[str, object] = {}

    def read(self, request, *args):
        string, streamed = super().read(request, *args)
        self.parts.setdefault(request.request_id, []).append(streamed)
        return string, streamed

    def text(self, request, stop_reason, unsent=None, *args):
        text = super().text(request, stop_reason, unsent, *args)
        parts = self.parts.setdefault(request.request_id, [])
        if unsent is not None:
            parts.pop()
        parts.append(text)
        self.stop_reasons[request.request_id] = stop_reason
        return text


def _run(at):
    """Runs CASES to the end, a SIGINT at the `at`-th line of the detokenizer's code."""
    sched = make_scheduler(num_blocks=32, block_size=4)
    sched.detokenizer = detokenizer = _Recording()
    requests = [
        add(sched, rid, b"Q: ", stream_text=True, **params) for rid, (_, params) in CASES.items()
    ]
    lines, interrupt = LineInterrupts(at, FILES), None
    while sched.has_unfinished_requests():
        out = sched.schedule()
        tokens = [_token_of(r) for r in out.requests]
        try:
            with lines:
                sched.update_from_output(out, tokens)
        except KeyboardInterrupt as e:
            assert interrupt is None and lines.fired
            interrupt = e
            sched.discard_unapplied()
    assert not sched.requests and not sched.running
    sched.manager.check_integrity()
    got = {
        r.request_id: (
            list(r.output_token_ids),
            r.status,
            detokenizer.stop_reasons.get(r.request_id),
            "".join(detokenizer.parts.get(r.request_id, ())),
        )
        for r in requests
    }
    return lines.fired, interrupt, got


def test_a_ctrl_c_in_the_detokenizer_streams_each_character_once_and_finds_each_string():
    # Let through after DecodedText.update moved its offsets, but before the tail and
    # the streamed count took the new text, a Ctrl-C dropped that text: never streamed,
    # and a stop string spanning it never found (the request ran on to max_tokens).
    *_, expected = _run(None)
    assert {rid: text for rid, (*_, text) in expected.items()} == EXPECTED
    assert {rid: (status, reason) for rid, (_, status, reason, _) in expected.items()} == {
        "a": (RequestStatus.FINISHED_STOPPED, "STOP"),
        "b": (RequestStatus.FINISHED_STOPPED, "\u20ac!"),
        "c": (RequestStatus.FINISHED_LENGTH, None),
        "d": (RequestStatus.FINISHED_STOPPED, "xy"),
        "e": (RequestStatus.FINISHED_STOPPED, None),
    }
    at = 0
    while True:
        at += 1
        fired, interrupt, got = _run(at)
        if fired is None:
            break
        assert interrupt is not None, fired
        if fired_in(fired, USER_CALLS):  # (a tokenizer interrupted may find a string later)
            continue
        assert got == expected, fired
        assert not raised_at_once(interrupt), fired  # raised once the update is done
    assert at > 300  # every line of the detokenizer's code in every update was tried


def test_the_user_code_flag_is_set_during_each_decode_and_only_then():
    """read() and text() set the UserCode passed in just around each call of the
    tokenizer's decode (a Ctrl-C then stops the tokenizer at once), and leave it unset."""
    flag, seen = UserCode(), []

    class Watched(ByteTokenizer):
        def decode(self, ids):
            seen.append(flag.runs)
            return super().decode(ids)

    detokenizer = Detokenizer(Watched())
    seen.clear()  # the check of decode([]) on construction is no request's read
    request = Request("r", list(b"Q: "), SamplingParams(stop="!", max_tokens=4))
    for token in b"ab!":
        request.append_output_token_ids(token)
        detokenizer.read(request, flag)
        assert not flag.runs
    request.status = RequestStatus.FINISHED_STOPPED
    assert detokenizer.text(request, "!", user_code=flag) == "ab"
    assert not flag.runs
    assert seen and all(seen)
