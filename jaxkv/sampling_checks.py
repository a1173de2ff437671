"""An engine's checks of a request's SamplingParams against its model and config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxkv.config import EngineConfig
    from jaxkv.models import LlamaConfig


def checked_sampling_params(
    params: SamplingParams | None, model_config: LlamaConfig, config: EngineConfig
) -> SamplingParams:
    """`params` (None: the defaults) as the engine runs them: stopping at the model's
    eos_token_ids too (SamplingParams.stopping_at). Raises ValueError unless `params`
    is None or a SamplingParams whose stop_token_ids lie below the model's vocab_size
    and whose logprobs and prompt_logprobs, if any, are at most config.max_logprobs."""
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params={params!r} must be None or a SamplingParams")
    vocab_size = model_config.vocab_size
    bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise ValueError(f"stop_token_ids {bad_stop} must be < {vocab_size=}")
    max_logprobs = config.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > max_logprobs:
            raise ValueError(f"SamplingParams.{name}={k} exceeds {max_logprobs=}")
    return params.stopping_at(model_config.eos_token_ids)
