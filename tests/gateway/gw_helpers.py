"""Helpers shared by the gateway tests (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

from typing import Any

from agl import semconv as sc
from agl.types import NewRollout

ADD_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def start_rollout(store: Any, rollout_id: str) -> tuple[str, int]:
    """Enqueue and claim a rollout: spans can only be stored for a running attempt."""
    store.enqueue([NewRollout(id=rollout_id)])
    claim = store.claim("test-worker")
    assert claim is not None and claim.rollout.id == rollout_id
    return rollout_id, claim.attempt.number


def server_spans(store: Any, rollout_id: str) -> list[Any]:
    return [
        s for s in store.query_spans(rollout_id=rollout_id) if s.attributes.get(sc.AGL_SIDE) == sc.SIDE_SERVER
    ]


def tiny_lm(kind: str = "llama", seed: int = 0, max_positions: int = 512) -> Any:
    """A tiny random Llama or Qwen2 (2 layers, hidden 32) over the shipped SmolLM2 tokenizer's vocabulary,
    in eval mode: a real transformers model that runs in milliseconds."""
    import torch
    import transformers

    from agl.chat.tokenizer import load_default_tokenizer

    tok = load_default_tokenizer()
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": tok._tok.get_vocab_size(),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": max_positions,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.eos_token_id,
        "tie_word_embeddings": True,
    }
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, use_sliding_window=False)
        ).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
