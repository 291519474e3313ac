"""The examples' shared ``train`` options: each example's parser has them and reads them back the same way."""

from __future__ import annotations

import pytest

from examples._cli import checkpointing_arg


@pytest.mark.parametrize("example", ["sql_agent", "calc_agent", "rag_agent"])
@pytest.mark.parametrize(("flag", "expected"), [([], None), (["on"], True), (["off"], False)])
def test_gradient_checkpointing_flag(example: str, flag: list[str], expected: bool | None) -> None:
    import importlib

    cli = importlib.import_module(f"examples.{example}.cli")
    argv = ["train", *(["--gradient-checkpointing", *flag] if flag else [])]
    args = cli.parser().parse_args(argv)
    assert checkpointing_arg(args) is expected


def test_gradient_checkpointing_flag_refuses_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    from examples.sql_agent import cli

    with pytest.raises(SystemExit) as exc:
        cli.parser().parse_args(["train", "--gradient-checkpointing", "yes"])
    assert exc.value.code == 2
    assert "invalid choice: 'yes'" in capsys.readouterr().err


@pytest.mark.parametrize("example", ["sql_agent", "calc_agent", "rag_agent"])
def test_mask_truncated_flag(example: str) -> None:
    """``--mask-truncated`` (DAPO's overlong filtering) is off unless asked for, in every recipe."""
    import importlib

    cli = importlib.import_module(f"examples.{example}.cli")
    assert cli.parser().parse_args(["train"]).mask_truncated is False
    assert cli.parser().parse_args(["train", "--mask-truncated"]).mask_truncated is True
