"""Each call of a seeded rollout gets a seed from the rollout's and its index (issue 53): on the span,
forwarded to vLLM, and an agent's own seed wins. Real gateway over HTTP, the OpenAI SDK as client, a fake
vLLM server reproducing vLLM's fields (vLLM cannot run here)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_vllm import FakeVLLM
from gw_helpers import server_spans

from agl import semconv as sc
from agl.gateway.backends.scripted import ScriptedBackend
from agl.gateway.backends.vllm import VLLMBackend
from agl.gateway.seeds import call_seed
from agl.gateway.testing import serve_asgi, serve_gateway
from agl.types import NewRollout

openai = pytest.importorskip("openai")

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


def _seeded(store: Any, rollout_id: str, seed: int | None) -> tuple[str, int]:
    meta = {} if seed is None else {sc.ROLLOUT_SEED_KEY: seed}
    store.enqueue([NewRollout(id=rollout_id, metadata=meta)])
    claim = store.claim("test-worker")
    assert claim is not None and claim.rollout.id == rollout_id
    return rollout_id, claim.attempt.number


@pytest.fixture
def upstream() -> Iterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM(["one", "two", "three", "four"])
    with serve_asgi(fake.app) as root:
        yield fake, root


def test_calls_of_a_seeded_rollout_get_their_place_seed_and_vllm_receives_it(
    store: Any, upstream: tuple[FakeVLLM, str]
) -> None:
    fake, root = upstream
    rid, attempt = _seeded(store, "ro-seeded", 77)
    with serve_gateway(VLLMBackend(root), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(rid, attempt), api_key="x")
        for _ in range(2):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=5)
    want = [call_seed(77, attempt, 0), call_seed(77, attempt, 1), 5]
    assert [body.get("seed") for kind, body in fake.requests if kind == "chat"] == want
    spans = sorted(server_spans(store, rid), key=lambda s: s.attributes[sc.AGL_LLM_CALL_INDEX])
    assert [s.attributes[sc.AGL_LLM_SEED] for s in spans] == want
    assert [s.attributes[sc.AGL_LLM_SEED_SOURCE] for s in spans] == ["run", "run", "agent"]
    assert [s.attributes[sc.AGL_LLM_CALL_INDEX] for s in spans] == [0, 1, 2]


def test_an_unseeded_rollout_and_a_call_outside_any_rollout_stay_unseeded(store: Any) -> None:
    rid, attempt = _seeded(store, "ro-plain", None)
    with serve_gateway(ScriptedBackend(["a", "b"]), store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(rid, attempt), api_key="x")
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        outside = openai.OpenAI(base_url=str(url), api_key="x")
        outside.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    (span,) = server_spans(store, rid)
    assert sc.AGL_LLM_SEED not in span.attributes and span.attributes[sc.AGL_LLM_CALL_INDEX] == 0
