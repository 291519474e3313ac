"""``agl sft --adapter-per-agent`` (issue 35): each agent's demonstrations train a LoRA adapter of its
own on the unchanged base model, saved as a peft folder per agent; RL starts each agent's adapter from
it (``Trainer(warm_adapters=...)``); bad input is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from test_sft import demo, tiny_model  # noqa: E402

import agl  # noqa: E402
from agl.algorithms.per_agent_lora import warm_adapters_dir  # noqa: E402
from agl.algorithms.sft import SFT  # noqa: E402
from agl.errors import UsageError  # noqa: E402
from agl.trainer.trainer import Trainer, load_tokenizer  # noqa: E402

AGENTS = ["writer", "re.writer"]  # the second's adapter is "re_writer"


def _demos() -> list[Any]:
    writer = demo("w", "What is 6 times 7?", "ANSWER: 42").model_copy(update={"agent": "writer"})
    rewriter = demo("r", "Fix: 6 x 7 = 41", "FIXED: 42").model_copy(update={"agent": "re.writer"})
    return [writer, rewriter]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    run = tmp_path_factory.mktemp("sft") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = SFT(adapter_per_agent=True, epochs=3, batch_size=1, learning_rate=1e-2, lora_r=4, lora_alpha=8)
        summary = cfg.fit(
            _demos(), tiny_model(), tokenizer=load_tokenizer(), agents=AGENTS, run_dir=run, progress=False
        )
    finally:
        torch.set_num_threads(threads)
    return run, summary


def test_each_agent_trains_its_own_adapter(sft_run: tuple[Path, dict[str, Any]]) -> None:
    from safetensors.torch import load_file

    run, summary = sft_run
    assert summary["agents"] == {"writer": "writer", "re.writer": "re_writer"}
    assert warm_adapters_dir(run) == run / "adapters"
    weights = {}
    for name in ("writer", "re_writer"):
        one = summary["adapters"][name]
        assert one["examples"] == 1 and one["agents"] == [
            {"writer": "writer", "re_writer": "re.writer"}[name]
        ]
        assert one["loss_after"] < one["loss_before"]
        assert (run / "adapters" / name / "adapter_config.json").is_file()
        weights[name] = load_file(str(run / "adapters" / name / "adapter_model.safetensors"))
    assert not (run / "model").exists()  # nothing merged: one base model serves every adapter
    b_keys = [k for k in weights["writer"] if "lora_B" in k]
    assert b_keys and any(weights["writer"][k].abs().max() > 0 for k in b_keys)  # trained away from zero
    assert any(not torch.equal(weights["writer"][k], weights["re_writer"][k]) for k in b_keys)


def test_rl_starts_each_adapter_from_its_warm_start(
    sft_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    run, _ = sft_run
    kw: dict[str, Any] = dict(
        backend="scripted", script=["x"], agents=AGENTS, adapter_per_agent=True, run_dir=tmp_path
    )
    trainer = Trainer(agl.LightningRL(lora_r=4, lora_alpha=8), warm_adapters=run, **kw)
    trainer.build_policy(tiny_model(), load_tokenizer())
    for name in ("writer", "re_writer"):
        saved = load_file(str(run / "adapters" / name / "adapter_model.safetensors"))
        state = get_peft_model_state_dict(trainer.policy.model, adapter_name=name)
        assert set(state) == set(saved)
        assert all(torch.equal(state[k].cpu(), saved[k]) for k in saved)
    with pytest.raises(UsageError, match="LoRA rank 4, the run's lora_r is 8"):
        Trainer(agl.LightningRL(lora_r=8, lora_alpha=16), warm_adapters=run, **kw)
    with pytest.raises(UsageError, match="needs adapter_per_agent=True"):
        Trainer(agl.LightningRL(lora_r=4), backend="scripted", script=["x"], warm_adapters=run)
    with pytest.raises(UsageError, match="holds no per-agent adapters"):
        Trainer(agl.LightningRL(lora_r=4, lora_alpha=8), warm_adapters=tmp_path / "nope", **kw)


def test_per_agent_sft_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"no demonstrations of agent\(s\) 'planner'.*'re.writer', 'writer'"):
        SFT(adapter_per_agent=True).fit(
            _demos(), tiny_model(), agents=["writer", "planner"], run_dir=tmp_path
        )
    with pytest.raises(UsageError, match="needs the agents to train by name"):
        SFT(adapter_per_agent=True).fit(_demos(), tiny_model(), run_dir=tmp_path)
    with pytest.raises(UsageError, match="needs lora=True"):
        SFT(adapter_per_agent=True, lora=False)


def test_the_examples_train_warm_starts_each_adapter(sft_run: tuple[Path, dict[str, Any]]) -> None:
    """``train --adapter-per-agent --warm-start SFT_DIR``: the base model the adapters were trained on
    (``--model`` when the SFT ran on a loaded model), and ``warm_adapters`` for the Trainer."""
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples package
    from examples._cli import model_arg, warm_adapters_arg

    run, _ = sft_run
    per_agent = argparse.Namespace(warm_start=str(run), adapter_per_agent=True, model="base-dir")
    assert model_arg(per_agent) == "base-dir" and warm_adapters_arg(per_agent) == str(run)
    shared = argparse.Namespace(warm_start=None, adapter_per_agent=False, model="base-dir")
    assert model_arg(shared) == "base-dir" and warm_adapters_arg(shared) is None


def test_a_shared_warm_start_is_the_base_of_an_adapter_per_agent(tmp_path: Path) -> None:
    """``train --adapter-per-agent --warm-start DIR`` where DIR is a shared ``agl sft`` run (a merged
    model, no per-agent adapters): the merged model is every agent's frozen base and each adapter starts
    fresh on it, so both setups start from the very same policy (issue 35's sql_agent comparison)."""
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples package
    from examples._cli import model_arg, warm_adapters_arg

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for per_agent in (True, False):
        args = argparse.Namespace(warm_start=str(tmp_path), adapter_per_agent=per_agent, model="base-dir")
        assert model_arg(args) == str(tmp_path / "model") and warm_adapters_arg(args) is None


def test_warm_adapters_of_other_target_modules_are_refused(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    for name in ("writer", "re_writer"):  # rank 4 as the run's, but LoRA on q_proj only
        model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
        model.save_pretrained(str(tmp_path / "adapters" / name))
    trainer = Trainer(
        agl.LightningRL(lora_r=4, lora_alpha=8),
        backend="scripted",
        script=["x"],
        agents=AGENTS,
        adapter_per_agent=True,
        run_dir=tmp_path / "run",
        warm_adapters=tmp_path,
    )
    with pytest.raises(UsageError, match=r"adapter 'writer' in .* has other target modules.*missing \(e.g. "):
        trainer.build_policy(tiny_model(), load_tokenizer())
