"""agl.SFT: selection, supervised training on recorded token ids with a tiny random model, and the
checkpoint served by the gateway's transformers backend through the real OpenAI client."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from agl.algorithms.sft import SFT, select_transitions, warm_start_model
from agl.errors import UsageError
from agl.types import Transition

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("peft")

QUESTION, ANSWER = "What is 6 times 7?", "ANSWER: 42"


def tiny_model() -> Any:
    from agl.chat.tokenizer import load_default_tokenizer

    tok = load_default_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok._tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


def demo(rid: str, question: str, answer: str, *, reward: float = 1.0, group: str = "g") -> Transition:
    """A transition as the gateway records it: the chat rendered by the shipped SmolLM2 template, the
    response ids ending with the end-of-turn token."""
    from agl.chat.tokenizer import load_default_tokenizer

    tok = load_default_tokenizer()
    messages = [{"role": "user", "content": question}]
    _, prompt_ids = tok.encode_chat(messages, None)
    return Transition(
        rollout_id=rid,
        attempt=1,
        group_id=group,
        agent="solver",
        index=0,
        prompt_ids=tuple(prompt_ids),
        response_ids=(*tok.encode(answer), tok.eos_token_id),
        messages=tuple(messages),
        response_text=answer,
        final_reward=reward,
        reward=reward,
    )


def test_selection_by_reward_and_best_of_group() -> None:
    ts = [
        demo("a", "q", "x", reward=0.2, group="g1"),
        demo("b", "q", "y", reward=0.9, group="g1"),
        demo("c", "q", "z", reward=0.9, group="g1"),
        demo("d", "q", "w", reward=0.5, group="g2"),
    ]
    assert [t.rollout_id for t in select_transitions(ts)] == ["a", "b", "c", "d"]
    assert [t.rollout_id for t in select_transitions(ts, min_reward=0.9)] == ["b", "c"]
    assert [t.rollout_id for t in select_transitions(ts, best_of_group=True)] == ["b", "d"]
    assert [t.rollout_id for t in select_transitions(ts, min_reward=0.6, best_of_group=True)] == ["b"]


def test_selection_drops_the_calls_air_penalised() -> None:
    """A rescued rollout: the writer's call wrote a failing query (AIR: -0.5), the rewriter's fixed
    it; the demonstration keeps the fix only, unless asked to keep the mistake too."""
    broken = demo("r", "q", "SELECT * FROM nowhere", reward=1.0).model_copy(
        update={"intermediate_reward": -0.5, "reward": 0.5}
    )
    fix = demo("r", "q", "SELECT 1", reward=1.0).model_copy(update={"index": 1, "agent": "rewriter"})
    ts = [broken, fix, demo("s", "q", "SELECT 2", reward=1.0)]
    assert [(t.rollout_id, t.index) for t in select_transitions(ts, drop_penalised=True)] == [
        ("r", 1),
        ("s", 0),
    ]
    assert len(select_transitions(ts)) == 3
    assert len(SFT().select(ts)) == 2 and len(SFT(drop_penalised=False).select(ts)) == 3
    with pytest.raises(UsageError, match="drop_penalised"):
        SFT(drop_penalised="yes")


@pytest.mark.parametrize(
    "kw",
    [
        {"epochs": 0},
        {"learning_rate": 0},
        {"min_reward": float("nan")},
        {"lora": "yes"},
        {"max_length": 1},
        {"merge_turns": 1},
        {"precision": "fp16"},
    ],
)
def test_bad_settings_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        SFT(**kw)


def test_nothing_to_train_on_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no demonstrations"):
        SFT(min_reward=1.0).fit([demo("a", "q", "x", reward=0.0)], tiny_model(), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing half-written
    with pytest.raises(FileNotFoundError, match="agl sft"):
        warm_start_model(tmp_path)


def test_sft_config_does_not_warn_about_transformers_checkpointing_rename(tmp_path: Path) -> None:
    """TRL's SFTConfig still passes ``gradient_checkpointing``, which transformers 5 renamed; the
    warning it raises on every ``agl sft`` is noise no user can act on, so agl hides it."""
    from agl.algorithms.sft import _trl_args

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trl_args(SFT(), tmp_path, 0, False)
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)], [
        str(w.message) for w in caught
    ]


def test_precision_runs_bf16_autocast_on_a_cpu_only_when_asked(tmp_path: Path) -> None:
    """``auto`` keeps a CPU on fp32 (bf16 is far slower there without AMX/AVX512-BF16); ``bf16``
    turns on transformers' CPU autocast; a bf16 run trains and saves fp32 weights that load anywhere."""
    from agl.algorithms.sft import _trl_args

    if torch.cuda.is_available():
        pytest.skip("the CPU choice")
    assert _trl_args(SFT(), tmp_path, 0, False)[0].bf16 is False
    assert _trl_args(SFT(precision="fp32"), tmp_path, 0, False)[0].bf16 is False
    assert _trl_args(SFT(precision="bf16"), tmp_path, 0, False)[0].bf16 is True

    from agl.trainer.trainer import load_tokenizer

    summary = SFT(epochs=2, batch_size=1, learning_rate=2e-2, lora=False, precision="bf16").fit(
        [demo("good", QUESTION, ANSWER)],
        tiny_model(),
        tokenizer=load_tokenizer(),
        run_dir=tmp_path / "sft",
        progress=False,
    )
    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft_loss"] for r in records if "sft_loss" in r]
    assert summary["steps"] == len(losses) == 2 and all(map(math.isfinite, losses))
    assert losses[1] < losses[0], losses  # the second step sees the first one's update
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(warm_start_model(tmp_path / "sft"))
    assert next(merged.parameters()).dtype == torch.float32


def test_sft_learns_its_demonstrations_and_the_gateway_serves_the_result(tmp_path: Path) -> None:
    from agl.gateway.backends.transformers import TransformersBackend
    from agl.gateway.testing import serve_gateway
    from agl.trainer.trainer import load_tokenizer

    openai = pytest.importorskip("openai")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # the rewarded demonstration, and a wrong one (reward 0) that min_reward leaves out
    demos = [demo("good", QUESTION, ANSWER), demo("bad", QUESTION, "ANSWER: 41", reward=0.0)]
    try:
        # full fine-tuning: a random 32-wide model's logits move too little under LoRA to be greedy-decoded
        # back; LoRA (the default) is exercised on the recipe's data in tests/examples/test_calc_agent.py
        summary = SFT(min_reward=1.0, epochs=30, batch_size=2, learning_rate=2e-2, lora=False).fit(
            demos, tiny_model(), tokenizer=load_tokenizer(), run_dir=tmp_path / "sft", progress=False
        )
    finally:
        torch.set_num_threads(threads)

    # trained on the rewarded demonstration only, loss on its response tokens only
    assert summary["examples"] == 1 and summary["rollouts"] == 1
    assert summary["response_tokens"] == len(demos[0].response_ids)
    assert summary["loss_after"] < 0.25 * summary["loss_before"], summary
    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft_loss"] for r in records if "sft_loss" in r]
    assert len(losses) == summary["steps"] == 30 and losses[-1] < losses[0]
    # LightningRL's checkpoint layout (TRL: weights + optimizer + trainer state) ...
    ckpt = Path(summary["checkpoint"])
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "trainer_state.json").is_file()
    assert (ckpt / "optimizer.pt").is_file()
    # ... and a merged plain model the gateway loads like any local model
    model_dir = warm_start_model(tmp_path / "sft")
    assert model_dir == tmp_path / "sft" / "model" and warm_start_model(model_dir) == model_dir

    backend = TransformersBackend(str(model_dir), model_name="warm", default_max_tokens=12)
    try:
        with serve_gateway(backend) as url:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
            out = client.chat.completions.create(
                model="warm", messages=[{"role": "user", "content": QUESTION}], temperature=0
            )
            assert out.choices[0].message.content == ANSWER  # greedy: the demonstration, end of turn included
            assert out.choices[0].finish_reason == "stop"
    finally:
        backend.engine._executor.shutdown(wait=False)


def _two_turns(rid: str = "conv") -> list[Transition]:
    """An agent's two calls where the second prompt continues the first exactly: prompt, response,
    then a tool result the model did not write, then the second response."""
    first = demo(rid, QUESTION, "<tool_call>6*7</tool_call>")
    tool = (7, 8, 9)
    second = first.model_copy(
        update={
            "index": 1,
            "prompt_ids": (*first.prompt_ids, *first.response_ids, *tool),
            "response_ids": (11, 12, first.response_ids[-1]),
        }
    )
    return [first, second]


def test_merge_turns_trains_a_conversation_as_one_sequence() -> None:
    from agl.algorithms.sft import _dataset, _sequences

    first, second = _two_turns()
    merged, n_merged = _dataset(_sequences([first, second], True), None)
    per_call, n_per_call = _dataset(_sequences([first, second], False), None)
    assert len(merged) == 1 and len(per_call) == 2
    # the same response tokens are trained on either way; the merged form encodes the history once
    assert n_merged == n_per_call == len(first.response_ids) + len(second.response_ids)
    row = merged[0]
    assert row["input_ids"] == [*second.prompt_ids, *second.response_ids]
    mask = row["completion_mask"]
    p = len(first.prompt_ids)
    assert mask[:p] == [0] * p
    assert mask[p : p + len(first.response_ids)] == [1] * len(first.response_ids)
    assert mask[p + len(first.response_ids) : p + len(first.response_ids) + 3] == [0, 0, 0]  # tool result
    assert mask[-len(second.response_ids) :] == [1] * len(second.response_ids)
    assert sum(len(r["input_ids"]) for r in per_call) > len(row["input_ids"])
    # over-long: the prompt loses its start, the completion keeps its tokens
    short, _ = _dataset(_sequences([first, second], True), len(row["input_ids"]) - 2)
    assert short[0]["input_ids"] == row["input_ids"][2:] and short[0]["completion_mask"] == mask[2:]


def test_sft_summary_counts_merged_sequences(tmp_path: Path) -> None:
    from agl.trainer.trainer import load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = SFT(epochs=1, batch_size=1, lora=False).fit(
            _two_turns(),
            tiny_model(),
            tokenizer=load_tokenizer(),
            run_dir=tmp_path / "m",
            progress=False,
            merge=False,
        )
        per_call = SFT(epochs=1, batch_size=2, lora=False, merge_turns=False).fit(
            _two_turns(),
            tiny_model(),
            tokenizer=load_tokenizer(),
            run_dir=tmp_path / "p",
            progress=False,
            merge=False,
        )
    finally:
        torch.set_num_threads(threads)
    assert summary["examples"] == per_call["examples"] == 2
    assert (summary["sequences"], summary["steps"]) == (1, 1) and per_call["sequences"] == 2
    assert summary["response_tokens"] == per_call["response_tokens"]
    # one forward pass on the merged sequence gives the per-call loss (both a mean over the same
    # response tokens, the per-call pair in one batch) on the same weights
    assert summary["loss_before"] == pytest.approx(per_call["loss_before"], rel=1e-4)
