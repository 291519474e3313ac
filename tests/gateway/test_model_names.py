"""Model names a program hard-codes: any name served by the policy (recorded on the span, listed in
/v1/models), case-insensitive, several names mapped to several models, strict mode. Real clients
against agl's real gateway on the scripted engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from gw_helpers import server_spans

from agl import semconv as sc
from agl.engine import EngineSettings
from agl.errors import UsageError
from agl.gateway.testing import ScriptedBackend, serve_gateway

openai = pytest.importorskip("openai")

MSG = [{"role": "user", "content": "hi"}]


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0)


def test_any_model_name_is_served_by_the_policy(store: Any, rollout: tuple[str, int]) -> None:
    backend = ScriptedBackend(["policy reply"], models=["SmolLM2-135M-Instruct"], on_exhausted="repeat")
    with serve_gateway(backend, store) as url:
        client = _client(url.for_rollout(*rollout))
        for name in ("gpt-4o", "gpt-4o-mini", "smollm2-135m-instruct"):  # the Agents SDK lowercases
            resp = client.chat.completions.create(model=name, messages=MSG)
            assert resp.choices[0].message.content == "policy reply"
            assert resp.model == name  # the reply names the model as the program asked for it
        listed = [m.id for m in client.models.list()]
        status = httpx.get(url.root + "/agl/v1/status").json()
    # the configured name, then the names served so far (the lowercased one is the policy's own name)
    assert listed == ["SmolLM2-135M-Instruct", "gpt-4o", "gpt-4o-mini"]
    assert status["model_names"]["any_name"] is True
    spans = server_spans(store, rollout[0])
    assert [s.attributes[sc.GEN_AI_REQUEST_MODEL] for s in spans] == [
        "gpt-4o",
        "gpt-4o-mini",
        "smollm2-135m-instruct",
    ]
    assert {s.attributes[sc.GEN_AI_RESPONSE_MODEL] for s in spans} == {"SmolLM2-135M-Instruct"}
    assert all(s.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS] for s in spans)


def test_streams_and_anthropic_replies_name_the_requested_model(store: Any, rollout: tuple[str, int]) -> None:
    with serve_gateway(ScriptedBackend(["hello"], on_exhausted="repeat"), store) as url:
        chunks = list(
            _client(url.for_rollout(*rollout)).chat.completions.create(
                model="gpt-4.1", messages=MSG, stream=True
            )
        )
        body = {"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": MSG}
        message = httpx.post(url.for_rollout(*rollout) + "/messages", json=body).json()
    assert {c.model for c in chunks} == {"gpt-4.1"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello"
    assert message["model"] == "claude-sonnet-4-5" and message["content"][0]["text"] == "hello"


def test_serve_maps_names_to_two_base_models(store: Any, rollout: tuple[str, int]) -> None:
    """AutoGen's SelectorGroupChat shape: agents on one name, the selector on another, each its model."""
    policy = ScriptedBackend(["from the policy"], on_exhausted="repeat")
    selector = ScriptedBackend(["from the selector"], models=["selector-model"], on_exhausted="repeat")
    with serve_gateway(policy, store, serve={"gpt-4o-mini": selector}) as url:
        client = _client(url.for_rollout(*rollout))
        big = client.chat.completions.create(model="gpt-4o", messages=MSG)
        small = client.chat.completions.create(model="GPT-4o-Mini", messages=MSG)
        listed = [m.id for m in client.models.list()]
    assert big.choices[0].message.content == "from the policy"
    assert small.choices[0].message.content == "from the selector"
    assert listed == ["scripted", "selector-model", "gpt-4o-mini", "gpt-4o"]
    s_big, s_small = server_spans(store, rollout[0])
    assert s_big.attributes[sc.GEN_AI_RESPONSE_MODEL] == "scripted"
    assert s_small.attributes[sc.GEN_AI_REQUEST_MODEL] == "GPT-4o-Mini"
    assert s_small.attributes[sc.GEN_AI_RESPONSE_MODEL] == "selector-model"
    assert s_small.attributes[sc.AGL_LLM_RESPONSE_TOKEN_IDS]  # exact on the second model too


def test_strict_mode_serves_only_the_names_given(store: Any, rollout: tuple[str, int]) -> None:
    selector = ScriptedBackend(["small"], models=["selector-model"], on_exhausted="repeat")
    backend = ScriptedBackend(["big"], on_exhausted="repeat")
    with serve_gateway(
        backend, store, only_model_names=True, model_names=["gpt-4o"], serve={"gpt-4o-mini": selector}
    ) as url:
        client = _client(url.for_rollout(*rollout))
        assert (
            client.chat.completions.create(model="GPT-4O", messages=MSG).choices[0].message.content == "big"
        )
        assert (
            client.chat.completions.create(model="gpt-4o-mini", messages=MSG).choices[0].message.content
            == "small"
        )
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model="gpt-4.1", messages=MSG)
        listed = [m.id for m in client.models.list()]
    assert "available: scripted, selector-model, gpt-4o, gpt-4o-mini" in str(info.value)
    assert listed == ["scripted", "selector-model", "gpt-4o", "gpt-4o-mini"]  # nothing else was served


def test_bad_model_name_settings_are_refused() -> None:
    backend = ScriptedBackend(["x"])
    from agl.gateway.app import create_app

    with pytest.raises(UsageError, match="non-empty"):
        create_app(backend, model_names=[" "])
    with pytest.raises(UsageError, match="given twice"):
        create_app(backend, serve={"a": "policy", "A": "base"})
    app = create_app(backend, serve={"writer-model": "writer"})  # no such adapter: refused at startup
    with pytest.raises(UsageError, match="'writer' is not one of the policy's adapters"):
        with serve_gateway(backend, serve={"writer-model": "writer"}):
            pass
    assert app.state.gateway.names.serve == {"writer-model": "writer"}


def test_serve_maps_names_to_the_policys_adapters(
    store: Any, rollout: tuple[str, int], tmp_path: Any
) -> None:
    """A LoRA per model name: ``--serve writer-model=writer`` and ``--serve judge-model=base`` on an engine
    with an adapter per agent (a tiny random Llama, peft's named adapters)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    from transformers import LlamaConfig, LlamaForCausalLM

    from agl.algorithms.lightning_rl import LightningRL
    from agl.algorithms.update import PolicyUpdate
    from agl.config import RunConfig
    from agl.gateway.backends.transformers import TransformersBackend
    from agl.trainer.trainer import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    run = RunConfig.resolve(LightningRL(lora_r=4, lora_alpha=8, mixed_precision="no"))
    policy = PolicyUpdate(
        LlamaForCausalLM(config),
        load_tokenizer(),
        run,
        output_dir=tmp_path / "ckpt",
        seed=0,
        adapters=["writer"],
    )
    backend = TransformersBackend.for_policy(
        policy, model_name="tiny", settings=EngineSettings(max_batch_size=2)
    )
    serve = {"writer-model": "writer", "judge-model": "base"}
    with serve_gateway(backend, store, serve=serve) as url:
        client = _client(url.for_rollout(*rollout))
        for name in ("writer-model", "judge-model", "gpt-4o:writer", "gpt-4o"):
            client.chat.completions.create(model=name, messages=MSG, max_tokens=2)
    adapters = [s.attributes[sc.AGL_LLM_ADAPTER] for s in server_spans(store, rollout[0])]
    assert adapters == ["writer", sc.BASE_ADAPTER, "writer", sc.BASE_ADAPTER]
