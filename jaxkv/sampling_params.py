"""SamplingParams: how a request picks its tokens and when it stops (host side, no JAX).

Shaped after vLLM's SamplingParams; every field is checked on construction, so a refused
value never reaches a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from jaxkv.field_checks import as_float, as_int, is_real
from jaxkv.stop_strings import checked_stop_strings

__all__ = ["SamplingParams"]

_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction.

    max_tokens None generates until a stop token or max_model_len. temperature 0 means
    greedy, and is the default (vLLM's is 1.0: pass a temperature to sample); top_k 0 (or
    -1, vLLM's older spelling, stored as 0) means no top-k cut; top_p 1.0 means no
    nucleus cut; min_p (in [0, 1], 0: no cut), as vLLM's, keeps only the tokens at least
    min_p times as likely as the most likely one, after temperature and before top-k and
    top-p. stop_token_ids None (vLLM's default) means none.
    seed: 64 bits, as torch's generators take (a negative seed counts modulo 2**64, but
    -1 means None, as in vLLM); a request with a seed draws the same random numbers
    whatever batch it runs in, so it samples the same tokens up to float rounding of its
    logits, which differ by about 1e-6 between batch layouts (cascade on or off, prefill
    chunks): a near-tie can still pick another token, as it can under greedy decoding.
    min_tokens: as vLLM's, the stop tokens (the model's EOS included, also under
    ignore_eos) cannot be sampled before the request has generated that many tokens; at
    most max_tokens.
    logprobs: None returns none; k >= 0 returns, for every output token, the sampled
    token's log-probability and the k most likely tokens' (jaxkv.logprobs), from the
    model's raw logits (before penalties, min_tokens' ban, temperature, min_p, top-k and
    top-p), as vLLM's default. An Engine refuses more than EngineConfig.max_logprobs.
    prompt_logprobs: None returns none; k >= 0 returns, for every prompt token after the
    first, its log-probability given the tokens before it and the k most likely tokens
    at its position (jaxkv.prompt_logprobs), as vLLM's. The request then reads no cached
    KV until its prompt is computed, as in vLLM (a cached block's positions have no
    logits). An Engine refuses more than EngineConfig.max_logprobs. Unlike vLLM, both
    refuse True (vLLM's 1) and -1 (vLLM's whole vocabulary): k is an int >= 0.
    n: how many samples of the prompt to generate, as vLLM's: an Engine runs them as n
    requests that share the prompt's cached KV (jaxkv.parallel_sampling); with a seed,
    sample i draws with seed + i. A Scheduler takes only n = 1. Greedy samples (temperature
    0, the default) are all the same, where vLLM refuses n > 1 without a temperature.
    presence_penalty, frequency_penalty (in [-2, 2]) and repetition_penalty (> 0) are
    vLLM's (jaxkv.penalties): each token's logit is divided by repetition_penalty if
    positive, else multiplied by it, when the token is in the prompt or the output so
    far; then frequency_penalty times its count in the output, and presence_penalty if
    it is there at all, are subtracted. 0, 0 and 1 change nothing.
    stop: strings (one str or a sequence) whose appearance in the output text ends the
    request, as vLLM's (jaxkv.stop_strings); an Engine needs a tokenizer to read them.
    include_stop_str_in_output: the finishing output's text (jaxkv.detokenizer) keeps the
    stop string, or the stop token's text, as vLLM's.
    stream_text: every RequestOutput carries the text its tokens add (jaxkv.detokenizer),
    as vLLM's RequestOutputKind.DELTA does, rather than only the finishing one the whole
    text; an Engine needs a tokenizer to read it.
    skip_special_tokens: as vLLM's, the text (and what stop strings are looked for in)
    leaves out the tokenizer's special tokens: passed to a decode that takes it (Hugging
    Face's); jaxkv.models.ByteTokenizer's decode always leaves them out.
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # Engine: do not stop at the model's eos_token_ids
    min_tokens: int = 0
    logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    stream_text: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0

    def __post_init__(self) -> None:
        """Checks every field; integers (numpy ones too) are stored as Python ints."""
        max_tokens, top_k = as_int(self.max_tokens), as_int(self.top_k)
        if self.max_tokens is not None and (max_tokens is None or max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1 or None")
        temperature = as_float(self.temperature)  # 10**400 overflows a float: NaN
        if not 0.0 <= temperature <= _FLOAT32_MAX:  # the sampler divides in float32
            raise ValueError(
                f"temperature={self.temperature!r} must be a number >= 0, finite in float32"
            )
        if top_k == -1:
            top_k = 0
        if top_k is None or top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 or -1 = off)")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1]")
        seed = None if self.seed is None else as_int(self.seed)
        if self.seed is not None and (seed is None or not -(2**63) <= seed < 2**64):
            raise ValueError(f"seed={self.seed!r} must be None or an int in [-2**63, 2**64)")
        if seed == -1:  # vLLM's spelling of no seed, which pass-through code sends
            seed = None
        try:
            # A mapping's keys, or bytes' values, would pass for the ids.
            if isinstance(self.stop_token_ids, (Mapping, bytes, bytearray)):
                raise TypeError
            ids = () if self.stop_token_ids is None else self.stop_token_ids  # vLLM's default
            stop = tuple(map(as_int, ids))
        except TypeError:  # not iterable: a lone id, None
            stop = (None,)
        if any(t is None or t < 0 for t in stop):
            raise ValueError(
                f"stop_token_ids={self.stop_token_ids!r} must be a sequence of ints >= 0"
            )
        bools = ("ignore_eos", "include_stop_str_in_output", "stream_text", "skip_special_tokens")
        for name in bools:
            if not isinstance(getattr(self, name), bool):  # "no" would count by its truthiness
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        min_tokens = as_int(self.min_tokens)
        if min_tokens is None or not 0 <= min_tokens <= (max_tokens or min_tokens):
            cap = "" if max_tokens is None else f" and <= max_tokens={max_tokens}"
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an int >= 0{cap}")
        logprobs, prompt_logprobs = (
            None if value is None else as_int(value)
            for value in (self.logprobs, self.prompt_logprobs)
        )
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if getattr(self, name) is not None and (value is None or value < 0):
                raise ValueError(f"{name}={getattr(self, name)!r} must be None or an int >= 0")
        n = as_int(self.n)
        if n is None or n < 1:
            raise ValueError(f"n={self.n!r} must be an int >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = as_float(getattr(self, name))
            if not -2.0 <= value <= 2.0:  # NaN fails too
                raise ValueError(f"{name}={getattr(self, name)!r} must be a number in [-2, 2]")
            object.__setattr__(self, name, value)
        # Compared as a Python float: a float16's own comparison with float32's bounds
        # would round them to 0 and inf, letting 0 and inf through. The sampler divides by
        # it in float32: one below float32's smallest normal number (1.2e-38) would be 0
        # or subnormal there, and turn every positive logit into inf.
        repetition = as_float(self.repetition_penalty)
        if not _FLOAT32_TINY <= repetition <= _FLOAT32_MAX:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty!r} must be a number > 0, normal "
                "and finite in float32 (in [1.2e-38, 3.4e38])"
            )
        object.__setattr__(self, "repetition_penalty", repetition)
        for name, value in (
            ("max_tokens", max_tokens),
            ("top_k", top_k),
            ("seed", seed),
            ("min_tokens", min_tokens),
            ("logprobs", logprobs),
            ("prompt_logprobs", prompt_logprobs),
            ("n", n),
        ):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "stop_token_ids", stop)
        object.__setattr__(self, "stop", checked_stop_strings(self.stop))

    @property
    def has_penalties(self) -> bool:
        """True unless every penalty is at its no-op value (0, 0 and 1)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def stopping_at(self, eos_token_ids: tuple[int, ...]) -> SamplingParams:
        """These params with `eos_token_ids` added to stop_token_ids (the model's end of
        generation, as vLLM takes it from the model's configs), unless ignore_eos."""
        stop = tuple(dict.fromkeys(self.stop_token_ids + tuple(eos_token_ids)))
        if self.ignore_eos or stop == self.stop_token_ids:
            return self
        return replace(self, stop_token_ids=stop)
