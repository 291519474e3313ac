"""The distribution maps core/ to agl and integrations/ to agl.integrations, ships py.typed and entry points."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("agl-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_maps_core_and_integrations(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "agl/__init__.py" in names
    assert "agl/types.py" in names
    assert "agl/store/base.py" in names
    assert "agl/py.typed" in names
    for integration in ("openai", "langchain", "openai_agents", "autogen", "crewai"):
        assert f"agl/integrations/{integration}/__init__.py" in names
    assert not any(n.startswith(("core/", "integrations/", "tests/")) for n in names)
    # every package in the tree is in the wheel: [tool.setuptools] packages is an explicit list
    for src, dest in ((ROOT / "core", "agl"), (ROOT / "integrations", "agl/integrations")):
        for init in src.rglob("__init__.py"):
            rel = init.relative_to(src).as_posix()
            if "__pycache__" not in rel:
                assert f"{dest}/{rel}" in names, f"{init.parent} is missing from pyproject's packages"
    assert "agl/algorithms/apo/loop.py" in names


def test_wheel_metadata_has_extras_entry_points_and_script(wheel: zipfile.ZipFile) -> None:
    dist_info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(f"{dist_info}/METADATA").decode()
    for extra in ("langchain", "openai-agents", "autogen", "crewai", "train", "tinker", "all"):
        assert f"Provides-Extra: {extra}" in metadata
    # The pins that keep a resolver off the legacy autogen 0.2 line.
    assert "autogen-agentchat==0.7.5" in metadata
    assert "torch" not in [
        line.split()[1]
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "[agl]" in entry_points and "langchain = agl.integrations.langchain" in entry_points
    assert "agl = agl.cli:main" in entry_points


def test_import_agl_is_light() -> None:
    code = "import sys, agl, agl.types, agl.store; print(sorted(m for m in ('torch','transformers','langchain_core','crewai','autogen_core','agents') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
