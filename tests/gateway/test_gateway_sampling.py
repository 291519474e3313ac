"""The gateway's sampling defaults and cap (``--max-tokens``, ``--temperature``, the Trainer's RunConfig):
a program that sets none gets them, one that asks more is capped, its own smaller values win. Real
OpenAI clients against agl's real gateway; the pass-through case forwards to a second real gateway."""

from __future__ import annotations

from typing import Any

import pytest
from gw_helpers import server_spans

from agl import semconv as sc
from agl.errors import UsageError
from agl.gateway.backends.openai import OpenAIBackend
from agl.gateway.sampling import SamplingLimits
from agl.gateway.testing import ScriptedBackend, serve_gateway
from agl.testing.fixtures import RecordingModel

openai = pytest.importorskip("openai")

MSG = [{"role": "user", "content": "count"}]
LONG = "one two three four five six seven eight nine ten eleven twelve"


def test_max_tokens_default_and_cap_and_temperature_default(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend([LONG], on_exhausted="repeat")
    limits = SamplingLimits(max_tokens=4, temperature=0.7)
    with serve_gateway(backend, store, sampling=limits) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", max_retries=0)
        unset = client.chat.completions.create(model="gpt-4o", messages=MSG)
        over = client.chat.completions.create(model="gpt-4o", messages=MSG, max_completion_tokens=100)
        under = client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=2, temperature=0.2)
    assert unset.choices[0].finish_reason == over.choices[0].finish_reason == "length"
    assert unset.usage.completion_tokens == over.usage.completion_tokens == 4
    assert under.usage.completion_tokens == 2  # the program's own smaller value wins
    s_unset, s_over, s_under = server_spans(store, rollout[0])
    assert s_unset.attributes[sc.GEN_AI_REQUEST_MAX_TOKENS] == 4
    assert s_unset.attributes[sc.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.7)
    assert s_over.attributes[sc.GEN_AI_REQUEST_MAX_TOKENS] == 4
    assert s_under.attributes[sc.GEN_AI_REQUEST_MAX_TOKENS] == 2
    assert s_under.attributes[sc.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.2)
    assert len(s_over.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]) == 4


def test_limits_reach_a_pass_through_upstream() -> None:
    """The pass-through backend forwards the program's body: the cap and default are written into it."""
    upstream = RecordingModel(lambda request: LONG)
    with serve_gateway(upstream.backend) as up:
        backend = OpenAIBackend(str(up), api_key="x", models=["scripted"])
        with serve_gateway(backend, sampling=SamplingLimits(max_tokens=3, temperature=0.5)) as url:
            client = openai.OpenAI(base_url=str(url), api_key="x", max_retries=0)
            client.chat.completions.create(model="gpt-4.1", messages=MSG, max_completion_tokens=50)
            client.completions.create(model="gpt-4.1", prompt="count:")
    chat, completion = (c.request for c in upstream.calls)
    assert chat.max_tokens == 3 and chat.temperature == pytest.approx(0.5)
    assert chat.raw["max_completion_tokens"] == 3 and "max_tokens" not in chat.raw
    assert completion.max_tokens == 3 and completion.temperature == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_bad_limits_are_refused(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        SamplingLimits(**kwargs)
