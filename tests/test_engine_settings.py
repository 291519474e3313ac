"""``agl.engine.EngineSettings``: every setting of the embedded engine spelled once, validated once, its
flags generated alike for ``agl train`` and ``agl gateway serve``, refused by name where a backend
cannot honour it, and carried whole from ``Serving`` through the Trainer to the engine."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest

import agl
from agl.cli import build_parser, main
from agl.engine import EngineSettings
from agl.engine import settings as engine_settings
from agl.errors import UsageError
from agl.run.settings import Serving

CORE = Path(agl.__file__).parent


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("prefix_cache_mb", -1),
        ("prefix_cache_mb", -0.5),
        ("prefix_cache_mb", math.nan),
        ("prefix_cache_mb", math.inf),
        ("prefix_cache_mb", True),
        ("prefix_cache_mb", "64"),
        ("prefix_cache_mb", None),
        ("dtype", "int8"),
        ("dtype", "bfloat"),
        ("dtype", 16),
        ("batched_lora", "yes"),
        ("deterministic", 1),
        ("max_batch_size", 0),
        ("max_batch_size", 2.0),
        ("threads", -1),
        ("threads", True),
    ],
)
def test_a_bad_setting_is_one_usage_error_naming_the_field(field: str, bad: Any) -> None:
    with pytest.raises(UsageError, match=rf"^EngineSettings\.{field} must be"):
        EngineSettings(**{field: bad})


def test_the_defaults_are_the_module_constants_and_dtype_names_are_normalised() -> None:
    s = EngineSettings()
    assert s.prefix_cache_mb == engine_settings.DEFAULT_PREFIX_CACHE_MB == 128.0
    assert s.max_batch_size == engine_settings.DEFAULT_MAX_BATCH_SIZE
    assert (s.dtype, s.threads, s.batched_lora, s.deterministic) == (None, 0, False, False)
    assert s.changed() == {} and s.rows == 8 and s.prefix_cache_bytes == 128 * 2**20
    assert (
        EngineSettings(dtype="BF16").dtype == "bfloat16" and EngineSettings(dtype="fp32").dtype == "float32"
    )
    assert (
        EngineSettings(dtype="auto").dtype == "auto"
        and EngineSettings(prefix_cache_mb=0).prefix_cache_mb == 0.0
    )
    det = EngineSettings(deterministic=True)
    assert det.rows == 1 and det.prefix_cache_bytes == 0  # one row at a time, no cached prefixes
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.prefix_cache_mb = 1.0  # type: ignore[misc]


def test_the_prefix_cache_default_is_written_once_in_core() -> None:
    hits = [
        f"{p.relative_to(CORE).as_posix()}:{n}"
        for p in CORE.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"128\.0", line)
    ]
    assert hits == [f"engine/settings.py:{_line_of('DEFAULT_PREFIX_CACHE_MB = 128.0')}"]


def _line_of(text: str) -> int:
    lines = (CORE / "engine" / "settings.py").read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.startswith(text))


def _engine_actions(command: str, *argv: str) -> dict[str, tuple[Any, ...]]:
    """The engine flags of ``agl COMMAND``: {dest: (option strings, default, type, choices, action, help)}."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    if command == "gateway":
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    group = next(g for g in sub._action_groups if "EngineSettings" in (g.title or ""))
    return {
        a.dest: (tuple(a.option_strings), a.default, a.type, a.choices, type(a).__name__, a.help)
        for a in group._group_actions
    }


def test_train_and_gateway_serve_offer_the_same_engine_flags_and_parse_them_alike() -> None:
    train, serve = _engine_actions("train"), _engine_actions("gateway")
    assert train == serve
    assert set(train) == {
        "engine_dtype",
        "prefix_cache_mb",
        "batched_lora",
        "deterministic",
        "max_batch_size",
        "threads",
    }
    flags = ["--engine-dtype", "bf16", "--prefix-cache-mb", "32", "--deterministic", "--max-batch-size", "3"]
    flags += ["--threads", "2", "--batched-lora"]
    from agl.cli.config_args import engine_from_args

    got_train = engine_from_args(build_parser("train").parse_args(["train", "--agent", "m:f", *flags]))
    got_serve = engine_from_args(build_parser("gateway").parse_args(["gateway", "serve", *flags]))
    want = EngineSettings(
        dtype="bfloat16",
        prefix_cache_mb=32,
        deterministic=True,
        max_batch_size=3,
        threads=2,
        batched_lora=True,
    )
    assert got_train == got_serve == want


def test_a_config_file_takes_the_engine_keys_of_the_flags(tmp_path: Path, capsys: Any) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("engine_dtype: auto\nprefix_cache_mb: 16\nthreads: 1\n")
    assert main(["train", "--agent", "m:f", "--config", str(cfg), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "engine_dtype: auto" in out and "prefix_cache_mb: 16" in out and "threads: 1" in out


def test_a_prefix_cache_asked_of_vllm_is_refused_naming_the_setting(capsys: Any) -> None:
    from agl.gateway.backends import from_spec

    asked = EngineSettings(prefix_cache_mb=64)
    with pytest.raises(UsageError, match=r"prefix_cache_mb=64\.0.*backend='vllm' cannot honour"):
        Serving(backend="vllm", vllm_url="http://127.0.0.1:9/v1", engine=asked)
    with pytest.raises(UsageError, match="prefix_cache_mb"):
        from_spec("vllm", url="http://127.0.0.1:9/v1", settings=asked)
    for other in ("openai", "scripted"):
        with pytest.raises(UsageError, match=rf"engine_dtype|dtype='auto'.*backend='{other}'"):
            Serving(backend=other, script=["x"], base_url="http://h/v1", engine=EngineSettings(dtype="auto"))
    Serving(backend="vllm", vllm_url="http://127.0.0.1:9/v1")  # the defaults ask nothing of vLLM
    argv = [
        "gateway",
        "serve",
        "--backend",
        "vllm",
        "--upstream",
        "http://127.0.0.1:9/v1",
        "--prefix-cache-mb",
        "64",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "prefix_cache_mb=64.0" in err and "backend='vllm'" in err and len(err.strip().splitlines()) == 1


def test_the_gateway_command_refuses_a_bad_engine_flag_in_one_line(capsys: Any) -> None:
    assert main(["gateway", "serve", "--backend", "transformers", "--prefix-cache-mb", "-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("EngineSettings.prefix_cache_mb must be a finite number >= 0 (0: off), got -5.0")
    assert len(err.splitlines()) == 1


def test_serving_carries_the_settings_whole_through_the_trainer_to_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from agl.run.environment import Environment
    from agl.trainer.trainer import Trainer, load_tokenizer

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    engine = EngineSettings(prefix_cache_mb=7, max_batch_size=3, dtype="float32")
    built: list[Any] = []
    make = Environment.make_backend

    def observed(self: Environment, **kwargs: Any) -> Any:
        built.append(make(self, **kwargs))  # the real backend, only recorded
        return built[-1]

    monkeypatch.setattr(Environment, "make_backend", observed)
    serving = Serving(
        model=model,
        tokenizer=load_tokenizer(),
        engine=engine,
        run_dir=tmp_path,
        runners=1,
        progress=False,
        store="memory://",
    )
    trainer = Trainer(serving=serving)
    assert trainer.serving.engine is engine
    trainer.dev(lambda task, resources: 1.0, [{"q": "x"}], show=False)
    (backend,) = built
    assert backend.settings is engine  # the very object the user gave
    assert backend.engine._prefix.budget_bytes == 7 * 2**20
    assert backend.engine.settings.rows == 3 and backend.serving_dtype is not None
