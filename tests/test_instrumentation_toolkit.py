"""The instrumentation toolkit: the patch ledger restores everything, safe_json never raises, guarded
logs once per site and counts every failure (in the plugin manager)."""

from __future__ import annotations

import json
import logging
import sys
import types
from dataclasses import dataclass

import pytest

from agl import plugins
from agl.instrumentation import PatchLedger, PatchTargetError, failure_counts, guarded, safe_json


@pytest.fixture()
def target(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A fresh module with a function, a class with its own and an inherited method, a staticmethod."""
    module = types.ModuleType("agl_ledger_target")

    def helper(x: int) -> int:
        return x + 1

    class Base:
        def inherited(self) -> str:
            return "base"

    class Thing(Base):
        def own(self, x: int) -> int:
            return x * 2

        @staticmethod
        def static(x: int) -> int:
            return -x

    module.helper, module.Base, module.Thing = helper, Base, Thing
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _plus_100(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 100


def _snapshot(module: types.ModuleType) -> dict[str, object]:
    return {
        "helper": vars(module)["helper"],
        "own": vars(module.Thing)["own"],
        "static": vars(module.Thing)["static"],
        "thing_keys": sorted(vars(module.Thing)),
        "base_keys": sorted(vars(module.Base)),
    }


def test_ledger_restores_every_patched_attribute(target: types.ModuleType) -> None:
    before = _snapshot(target)
    ledger = PatchLedger("test")
    assert ledger.wrap("agl_ledger_target:helper", _plus_100)
    assert ledger.wrap("agl_ledger_target:Thing.own", _plus_100)
    assert ledger.wrap("agl_ledger_target:Thing.static", _plus_100)
    assert ledger.wrap((target.Thing, "inherited"), lambda w, i, a, k: w(*a, **k) + "!")
    assert ledger.replace("agl_ledger_target:Base.inherited", lambda original: lambda self: "replaced")

    thing = target.Thing()
    assert target.helper(1) == 102 and thing.own(2) == 104 and target.Thing.static(3) == 97
    assert thing.inherited() == "base!" and target.Base().inherited() == "replaced"
    assert len(ledger) == 5 and ledger.problems() == []

    ledger.unpatch_all()
    assert _snapshot(target) == before  # the inherited method's wrapper on Thing is gone, not shadowing
    assert target.helper(1) == 2 and thing.own(2) == 4 and thing.inherited() == "base" and len(ledger) == 0


def test_ledger_is_idempotent(target: types.ModuleType) -> None:
    ledger = PatchLedger("test")
    assert ledger.wrap("agl_ledger_target:helper", _plus_100)
    assert not ledger.wrap("agl_ledger_target:helper", _plus_100)  # patched once, not twice
    assert target.helper(0) == 101 and len(ledger) == 1
    ledger.unpatch_all()
    ledger.unpatch_all()
    assert target.helper(0) == 1


def test_ledger_leaves_a_later_patch_alone_and_reports_it(target: types.ModuleType) -> None:
    ledger = PatchLedger("test")
    ledger.wrap("agl_ledger_target:helper", _plus_100)

    def theirs(x: int) -> int:
        return 0

    target.helper = theirs
    assert ledger.problems() == ["agl_ledger_target.helper was replaced after agl patched it"]
    ledger.unpatch_all()
    assert target.helper is theirs


def test_ledger_missing_target_raises_or_warns(target: types.ModuleType, caplog) -> None:
    ledger = PatchLedger("test")
    with pytest.raises(PatchTargetError, match="not supported"):
        ledger.wrap("agl_ledger_target:Thing.nope", _plus_100)
    with pytest.raises(PatchTargetError):
        ledger.wrap("agl_no_such_module_xyz:f", _plus_100)
    with pytest.raises(ValueError, match="module:attribute"):
        ledger.wrap("agl_ledger_target.helper", _plus_100)
    with caplog.at_level(logging.WARNING, "agl.instrumentation"):
        assert not ledger.wrap("agl_ledger_target:Thing.nope", _plus_100, optional="that part is off")
    assert "that part is off" in caplog.text and len(ledger) == 0


@dataclass
class _Point:
    x: int


class _Model:
    def model_dump(self, mode: str = "python", exclude_none: bool = False) -> dict[str, object]:
        return {"mode": mode, "none_dropped": exclude_none}


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_safe_json_never_raises() -> None:
    assert safe_json("already text") == "already text"
    assert json.loads(safe_json({"a": [1, 2], "m": _Model()})) == {
        "a": [1, 2],
        "m": {"mode": "json", "none_dropped": True},
    }
    assert json.loads(safe_json({"s": {3}, "b": b"hi", "t": (1,)})) == {"s": [3], "b": "hi", "t": [1]}
    assert json.loads(safe_json({"p": _Point(1)})) == {"p": "_Point(x=1)"}
    loop: list[object] = []
    loop.append(loop)
    assert safe_json(loop) == "[[...]]"
    assert safe_json(_Unprintable()) == "<_Unprintable>"
    assert safe_json("x" * 10, max_chars=4) == "xxxx…"
    assert safe_json({"é": "ü"}) == '{"é":"ü"}'


def test_guarded_logs_once_per_site_counts_all_and_lives_in_the_plugin_manager(caplog) -> None:
    site = "test.guarded_site"
    before = failure_counts(site).get(site, 0)
    with caplog.at_level(logging.WARNING, "agl.instrumentation"):
        for _ in range(3):
            with guarded(site):
                raise ValueError("boom")
            # the code after the block runs: the failure did not propagate

        @guarded("test.guarded_fn", default="fallback")
        def hook(x: int) -> str:
            raise KeyError(x)

        assert hook(1) == "fallback"
    assert failure_counts(site)[site] == before + 3
    assert plugins.get_plugin_manager().failures.counts("test.")[site] == before + 3
    assert caplog.text.count("test.guarded_site failed") == (1 if before == 0 else 0)
    assert "test.guarded_fn failed" in caplog.text

    with pytest.raises(KeyboardInterrupt), guarded(site):  # never swallows interrupts
        raise KeyboardInterrupt
