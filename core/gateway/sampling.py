"""Gateway-side sampling defaults and caps: what a program that sets none gets, and the most it may ask.

Programs written for a hosted API rarely set ``max_tokens``; on a local engine each of their calls may
then generate the engine's whole default (512 tokens: minutes per reply on a CPU). ``agl gateway serve
--max-tokens N --temperature T`` and the Trainer (from its :class:`agl.RunConfig`) set them here, for
every backend and every API (chat, completions, Responses, Anthropic Messages):

- ``max_tokens``: the default for a request that sets none, and the cap for one that asks more (a
  program's own smaller value wins);
- ``temperature``: the default for a request that sets none (a program's own value wins).

The values are written into the request the backend sees, including the body a pass-through backend
forwards, and the span records what was applied (``gen_ai.request.max_tokens``/``temperature``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from agl.errors import UsageError
from agl.gateway.backends.base import GenerationRequest

__all__ = ["SamplingLimits"]

#: the routes whose raw body a pass-through backend forwards as it is
_FORWARDED = ("chat", "completions")


@dataclass(frozen=True)
class SamplingLimits:
    """``max_tokens`` (default and cap) and ``temperature`` (default); None leaves a setting alone."""

    max_tokens: int | None = None
    temperature: float | None = None

    def __post_init__(self) -> None:
        m = self.max_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise UsageError(f"max_tokens must be an integer >= 1, got {m!r}")
        t = self.temperature
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= 2
        ):
            raise UsageError(f"temperature must be a number in [0, 2], got {t!r}")

    @classmethod
    def from_config(cls, config: Any) -> SamplingLimits:
        """The Trainer's: its :class:`agl.RunConfig`'s ``max_tokens`` and ``temperature``."""
        return cls(max_tokens=int(config.max_tokens), temperature=float(config.temperature))

    def __bool__(self) -> bool:
        return self.max_tokens is not None or self.temperature is not None

    def apply(self, gen: GenerationRequest) -> None:
        """Fill in the defaults and apply the cap on ``gen`` (and the body it forwards)."""
        raw = gen.raw if gen.api in _FORWARDED else None
        if self.max_tokens is not None and (gen.max_tokens is None or gen.max_tokens > self.max_tokens):
            gen.max_tokens = self.max_tokens
            if raw is not None:
                key = "max_completion_tokens" if "max_completion_tokens" in raw else "max_tokens"
                raw[key] = self.max_tokens
                if key == "max_completion_tokens":
                    raw.pop("max_tokens", None)
        if self.temperature is not None and gen.temperature is None:
            gen.temperature = float(self.temperature)
            if raw is not None:
                raw["temperature"] = float(self.temperature)
