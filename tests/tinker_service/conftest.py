"""The real skyrl-tx Tinker server the tests in this folder train against (no stub of the service).

``$AGL_TINKER_PYTHON`` names an interpreter with skyrl-tx installed (``scripts/tinker-env.sh DIR``).
Without it the tests that need the server are skipped, saying why; under ``AGL_TINKER_REQUIRED=1``
(the ``tinker`` tox env) a missing server or SDK fails them instead. One server serves the whole
session (a JAX engine compiles once per request shape; ``$AGL_JAX_CACHE`` keeps the compiled shapes on
disk), and every run uses the same shapes (learn_on_cpu's prompts, ``max_tokens=16``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

#: the examples are imported from the repository root (as ``python -m examples.<name>`` runs them)
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK's telemetry: nowhere to send it here


def _missing(why: str) -> None:
    if os.environ.get("AGL_TINKER_REQUIRED") == "1":
        pytest.fail(f"AGL_TINKER_REQUIRED=1 but {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def tinker_python() -> str:
    """The skyrl-tx interpreter (skip, or fail under AGL_TINKER_REQUIRED=1, without one) and the SDK."""
    from agl.tinker.server import tinker_python_from_env

    python = tinker_python_from_env()
    if python is None:
        _missing("needs AGL_TINKER_PYTHON (an interpreter with skyrl-tx: scripts/tinker-env.sh DIR)")
    try:
        import tinker  # noqa: F401
    except ImportError:
        _missing("needs the tinker SDK (pip install tinker==0.12.0 for skyrl-tx 0.3.0)")
    return str(python)


@pytest.fixture(scope="session")
def skyrl(tinker_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """SkyRL's Tinker server on the default model (SmolLM2-135M-Instruct): LoRA slots of rank 8 for two
    adapters (the per-agent test) and a restore; the runs' own servers have the same slot count, so the
    compiled programs in the JAX cache serve them all."""
    from agl.chat.models import prepare_default_model
    from agl.tinker.server import SkyRLServer

    server = SkyRLServer(
        prepare_default_model(progress=False),
        python=tinker_python,
        state_dir=tmp_path_factory.mktemp("skyrl"),
        lora_rank=8,
        adapters=2,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
