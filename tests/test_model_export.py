"""``agl export model``: a trained run as a folder users load directly, with a card that tells the truth.

learn_on_cpu's own training command (``_train_one``: its agent, its data, its ``summary.json``) runs on a
tiny random Llama saved as a folder, served by the scripted engine whose replies alternate right and
wrong (every GRPO group has a spread, so the LoRA really trains). Its last checkpoint is exported as a
peft adapter and merged: both load with transformers and greedy-decode exactly the tokens of the
trained policy in memory on 5 of the run's prompts; the card names the base model, the steps and the
run's held-out figures. An adapter-per-agent run exports one folder per agent, and agl's gateway
(``agl gateway serve --model DIR``, real, on 127.0.0.1) serves each agent's name with its own adapter.
Bad inputs are refused in one line, leaving no folder behind.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import agl  # noqa: E402
from agl.chat.tokenizer import load_tokenizer  # noqa: E402
from agl.cli import main  # noqa: E402
from agl.tracing import provider as tracing  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])  # `examples` lives at the repository root
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

AGENTS = ["writer", "rewriter"]


def tiny_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny random Llama with the shipped SmolLM2 tokenizer, saved as a model folder."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return folder


class Alternating:
    """The scripted engine: the calculator's last result as ``Answer: N`` on every other call, a wrong
    reply otherwise, so each group of two has one right and one wrong rollout."""

    def __init__(self) -> None:
        self.n, self.lock = 0, threading.Lock()

    def __call__(self, request: Any) -> str:
        last = re.findall(r"= (-?\d+)", request.messages[-1]["content"])
        with self.lock:
            self.n += 1
            good = self.n % 2
        return f"Answer: {last[-1]}" if good and last else "I am not sure."


@pytest.fixture(scope="module")
def learn_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """learn_on_cpu's ``train`` (its own _train_one) on the tiny model: the run directory, the tiny base
    and the trained policy (the Trainer's PolicyUpdate after fit)."""
    import examples.learn_on_cpu.__main__ as demo

    root = tmp_path_factory.mktemp("learn")
    base = tiny_folder(root / "tiny")
    flags = ["train", "--model", str(base), "--steps", "2", "--tasks-per-step", "2", "--group-size", "2"]
    flags += ["--val-size", "4", "--val-every", "1", "--runners", "2", "--lora-r", "4", "--lr", "5e-2"]
    args = demo.parser().parse_args([*flags, "--run-dir", str(root / "run"), "--seed", "3"])
    args.backend, args.script, args.progress = "scripted", Alternating(), False
    made: list[Any] = []

    def trainer(*a: Any, **kw: Any) -> Any:
        made.append(real(*a, **kw))
        return made[-1]

    real = demo._trainer
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo, "_trainer", trainer)
        try:
            demo._train_one(args, 3, root / "run")
        finally:
            agl.uninstrument()
            tracing.reset_tracing()
    return {"run": root / "run", "base": base, "policy": made[0].policy, "root": root}


def chat_ids(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def prompts() -> list[list[int]]:
    """5 of learn_on_cpu's held-out prompts, rendered as the gateway renders them."""
    from examples.learn_on_cpu.agent import build_messages, calculate
    from examples.learn_on_cpu.data import split

    tok = load_tokenizer()
    _, val = split(n_val=5)
    out = []
    for task in val:
        steps: list[str] = []
        calculate(task["expression"], steps)
        out.append(chat_ids(tok, build_messages(task["question"], steps)))
    return out


def greedy(model: Any, prompt: list[int], n: int = 8) -> list[int]:
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def one_line_error(capsys: pytest.CaptureFixture[str], rc: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agl export: error:"), err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_the_run_exports_as_an_adapter_and_merged_with_the_trained_policys_tokens(
    learn_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, base = learn_run["run"], learn_run["base"]
    assert main(["export", "model", str(run), "--out", str(tmp_path / "adapter")]) == 0
    assert main(["export", "model", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    printed = capsys.readouterr().out
    assert f"agl gateway serve --model {tmp_path / 'adapter'}" in printed
    adapter_files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    } <= adapter_files
    assert not adapter_files & {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    merged_files = {p.name for p in (tmp_path / "merged").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= merged_files

    policy = learn_run["policy"].full_model
    plain = AutoModelForCausalLM.from_pretrained(str(base))
    exported = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(tmp_path / "adapter")
    )
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    changed = False
    for prompt in prompts():
        expect = greedy(policy, prompt)
        assert greedy(exported, prompt) == expect
        assert greedy(merged, prompt) == expect
        with torch.no_grad():  # the adapter is trained: it moves the base model's logits
            ids = torch.tensor([prompt])
            delta = (exported(ids).logits - plain(ids).logits).abs().max().item()
        changed = changed or delta > 1e-4
    assert changed


def test_the_card_states_the_runs_base_model_steps_and_held_out_figures(
    learn_run: dict[str, Any], tmp_path: Path
) -> None:
    run, base = learn_run["run"], learn_run["base"]
    assert main(["export", "model", str(run), "--out", str(tmp_path / "out")]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    summary = json.loads((run / "summary.json").read_text())
    header = card.split("---")[1]
    assert f'base_model: "{base.resolve()}"' in header and "library_name: peft" in header
    assert f"`{base.resolve()}`" in card
    assert f"agl {agl.__version__}" in card
    assert "agents trained: calculator_agent" in card
    assert "loop step 2 of 2 (2 policy update(s))" in card
    before, after = f"{summary['val_reward_before']:.3f}", f"{summary['val_reward_after']:.3f}"
    assert f"| before training (step 0) | {before} | 4 |" in card
    assert f"| end of the run (step 2) | {after} | 4 |" in card
    assert f"Seed {summary['seed']};" in card and summary["seed"] == 3
    assert "LightningRL" in card and "group_size=2" in card and "lora_r=4" in card
    assert "The reward is 1 for a reply in that format with the right number" in card  # learn_on_cpu's
    assert "--lora-modules out=" in card and "--max-lora-rank 8" in card  # vLLM's smallest rank >= 4
    for untrue in ("None", "More Information Needed", "huggingface.co/None"):
        assert untrue not in card
    # neither TRL's card nor peft's blank one lands beside the checkpoints any more
    assert not list((run / "checkpoints").glob("**/README.md"))


def test_best_and_step_pick_a_checkpoint_and_say_which(learn_run: dict[str, Any], tmp_path: Path) -> None:
    from agl.reports.model_export import find_checkpoint

    run = learn_run["run"]
    last = find_checkpoint(run)
    assert last.update_step == 2 and last.step == 2 and last.kind == "adapter"
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert find_checkpoint(run, best=True).step == 2  # the only checkpoint with a check at its step
    assert find_checkpoint(run, step=2).path == last.path
    assert any(h.get("step") == 2 and h.get("val_reward") is not None for h in history)


def test_bad_inputs_are_refused_in_one_line_and_leave_no_folder(
    learn_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = learn_run["run"]
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    out = tmp_path / "out"
    cases = [
        ([str(empty_run)], ["holds no checkpoint"]),
        ([str(tmp_path / "missing")], ["no such run directory"]),
        ([str(run), "--step", "7"], ["no checkpoint-7", "its checkpoints: 2"]),
        ([str(run), "--dtype", "bfloat16"], ["--dtype", "--merge"]),
        ([str(run), "--merge", "--base", str(empty_run)], ["--merge needs the base model's folder"]),
    ]
    for extra, words in cases:
        rc = main(["export", "model", *extra, "--out", str(out)])
        one_line_error(capsys, rc, *words)
        assert not out.exists()
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no partial folder
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    one_line_error(capsys, main(["export", "model", str(run), "--out", str(taken)]), "is not empty")
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]


# ------------------------------------------------------------------------------ an adapter per agent


@pytest.fixture(scope="module")
def per_agent_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two agents, each with its own LoRA, trained two steps on the tiny base (transformers backend)."""
    root = tmp_path_factory.mktemp("per_agent")
    base = tiny_folder(root / "tiny", seed=1)
    counter, lock = itertools.count(), threading.Lock()

    def app(task: dict, resources: agl.Resources) -> float:
        llm = resources.llm
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key or "x")
        msgs = [{"role": "user", "content": task["q"]}]
        for agent in AGENTS:
            with agl.agent(agent):
                client.chat.completions.create(model=llm.model, messages=msgs, max_tokens=4)
        with lock:
            return float(next(counter) % 2)

    trainer = agl.Trainer(
        agl.LightningRL(group_size=2, lora_r=4, lora_alpha=8, learning_rate=1e-1, mixed_precision="no"),
        model=str(base),
        agents=AGENTS,
        adapter_per_agent=True,
        steps=2,
        tasks_per_step=1,
        val_before=False,
        runners=2,
        run_dir=root / "run",
        progress=False,
        store="memory://",
    )
    agl.instrument("openai")
    try:
        trainer.fit(app, [{"q": "hello"}, {"q": "write a line"}])
    finally:
        agl.uninstrument()
        tracing.reset_tracing()
    return {"run": root / "run", "base": base, "policy": trainer.policy}


def test_an_adapter_per_agent_exports_a_folder_per_agent_served_under_each_agents_name(
    per_agent_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from agl.cli.gateway import build_backend, gateway_options, register_cli
    from agl.gateway.testing import serve_gateway

    run, base = per_agent_run["run"], per_agent_run["base"]
    out = tmp_path / "agents"
    rc = main(["export", "model", str(run), "--out", str(tmp_path / "m"), "--merge"])
    one_line_error(capsys, rc, "--merge is refused for an adapter per agent", "one base model")
    assert not (tmp_path / "m").exists()
    assert main(["export", "model", str(run), "--out", str(out)]) == 0
    manifest = json.loads((out / "agl_export.json").read_text())
    assert manifest["kind"] == "adapters" and manifest["agents"] == {a: a for a in AGENTS}
    card = (out / "README.md").read_text()
    assert "--lora-modules writer=" in card and "rewriter=" in card and "None" not in card

    tok = load_tokenizer()
    messages = [{"role": "user", "content": "write a line"}]
    prompt = chat_ids(tok, messages)
    expect = {}
    for agent in AGENTS:  # each exported folder, loaded alone with peft
        model = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(base)), str(out / agent)
        )
        expect[agent] = tok.decode(greedy(model, prompt, 12), skip_special_tokens=True)
    plain = tok.decode(
        greedy(AutoModelForCausalLM.from_pretrained(str(base)), prompt, 12), skip_special_tokens=True
    )
    assert len({expect["writer"], expect["rewriter"], plain}) == 3  # three different models to tell apart

    parser = argparse.ArgumentParser()
    register_cli(parser)
    args = parser.parse_args(["serve", "--model", str(out)])  # no store: calls served, no spans
    backend = build_backend(args)
    with serve_gateway(backend, **gateway_options(args, backend)) as url:
        client = openai.OpenAI(base_url=str(url), api_key="x")
        for agent in AGENTS:
            reply = client.chat.completions.create(
                model=agent, messages=messages, max_tokens=12, temperature=0
            )
            assert reply.choices[0].message.content == expect[agent]
        other = client.chat.completions.create(
            model="gpt-4o", messages=messages, max_tokens=12, temperature=0
        )
        assert other.choices[0].message.content == plain  # an agent nobody trained: the base model


def test_the_gateway_serves_a_shared_adapter_export_under_any_name(
    learn_run: dict[str, Any], tmp_path: Path
) -> None:
    import argparse

    from agl.cli.gateway import build_backend, gateway_options, register_cli
    from agl.gateway.testing import serve_gateway

    out = tmp_path / "adapter"
    assert main(["export", "model", str(learn_run["run"]), "--out", str(out)]) == 0
    tok = load_tokenizer()
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = chat_ids(tok, messages)
    expect = tok.decode(greedy(learn_run["policy"].full_model, prompt, 8), skip_special_tokens=True)
    parser = argparse.ArgumentParser()
    register_cli(parser)
    args = parser.parse_args(["serve", "--model", str(out)])
    backend = build_backend(args)
    with serve_gateway(backend, **gateway_options(args, backend)) as url:
        client = openai.OpenAI(base_url=str(url), api_key="x")
        for name in ("adapter", "gpt-4o-mini"):
            reply = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
            assert reply.choices[0].message.content == expect
