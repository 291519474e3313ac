"""The one door to the installed ``bfcl-eval`` package: its data, its tool conversion and its checkers.

Nothing of BFCL is copied into this project: the test cases, possible answers, function docs, the AST
checker, the multi-turn checker and the executable API classes are all read from the installed
``bfcl_eval`` (``pip install --no-deps bfcl-eval==2026.3.23`` and the packages listed in
:data:`EXTRA_PACKAGES`; see README.md). ``bfcl_eval`` is imported only inside these functions, so the
example's other modules import without it and :func:`unavailable` says why it cannot run.

BFCL's lock files and result folders go under ``BFCL_PROJECT_ROOT``, set here (when unset) to the
agl cache (``~/.cache/agl/examples/bfcl_agent``) so nothing is written into site-packages.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKER_MODEL",
    "EXTRA_PACKAGES",
    "PACKAGE",
    "ast_check",
    "load_answers",
    "load_cases",
    "multi_turn_check",
    "tools_for",
    "unavailable",
]

#: the pinned release whose data and checkers the figures were measured with
PACKAGE = "bfcl-eval==2026.3.23"
#: what ``bfcl_eval``'s checker modules import beyond agl's own dependencies (installed with
#: ``--no-deps``; the checkers import ``bfcl_eval.constants.model_config``, which imports every
#: provider handler, hence the SDKs)
EXTRA_PACKAGES = (
    "tree-sitter==0.21.3",
    "tree-sitter-java==0.21.0",
    "tree-sitter-javascript==0.21.4",
    "cohere==5.18.0",
    "fastavro==1.13.1",
    "google-genai==3.6.1",
    "mistralai==1.7.0",
    "boto3==1.44.8",
    "botocore==1.44.8",
    "s3transfer==0.19.3",
    "jmespath==1.1.0",  # botocore imports it; without it `import accelerate` fails (it probes boto3)
    "qwen-agent==0.0.34",
    "soundfile==0.14.0",
    "dashscope==2.0.2",
    "writer-sdk==3.0.0",
    "datamodel-code-generator==0.89.0",
)
#: the BFCL model entry whose checker settings an OpenAI-style function-calling client gets: tool
#: names with dots are sent with underscores (OpenAI's name rule) and mapped back by the checker
CHECKER_MODEL = "gpt-4o-2024-11-20-FC"


def _project_root() -> None:
    if "BFCL_PROJECT_ROOT" not in os.environ:
        from agl.chat.models import cache_dir

        root = cache_dir() / "examples" / "bfcl_agent"
        (root / ".file_locks").mkdir(parents=True, exist_ok=True)
        os.environ["BFCL_PROJECT_ROOT"] = str(root)


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None when ``bfcl_eval``'s data and both checkers import; else one line saying what is missing."""
    _project_root()
    try:
        import bfcl_eval.eval_checker.ast_eval.ast_checker  # noqa: F401
        import bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker  # noqa: F401
        import bfcl_eval.utils  # noqa: F401
    except ImportError as exc:
        return f"bfcl_eval is not importable ({exc}): pip install --no-deps {PACKAGE} " + " ".join(
            EXTRA_PACKAGES
        )
    return None


def _require() -> None:
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)


def data_dir() -> Path:
    """The installed package's ``data`` folder (test files, possible answers, function docs)."""
    _require()
    from bfcl_eval.constants.eval_config import PROMPT_PATH

    return Path(PROMPT_PATH)


@functools.cache
def _cases(category: str) -> tuple[dict[str, Any], ...]:
    _require()
    from bfcl_eval.utils import load_dataset_entry

    return tuple(load_dataset_entry(category))


def load_cases(category: str) -> list[dict[str, Any]]:
    """BFCL's test entries of ``category`` as its own runner loads them (function docs with BFCL's
    language hint; multi-turn entries with their classes' docs filled in)."""
    import copy

    return copy.deepcopy(list(_cases(category)))


@functools.cache
def _answers(category: str) -> dict[str, Any]:
    _require()
    from bfcl_eval.utils import load_ground_truth_entry

    return {e["id"]: e["ground_truth"] for e in load_ground_truth_entry(category)}


def load_answers(category: str) -> dict[str, Any]:
    """``{case id: ground_truth}`` from BFCL's possible-answer file (none for irrelevance)."""
    if category == "irrelevance":
        return {}
    return dict(_answers(category))


def tools_for(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL's function docs as OpenAI ``tools``, converted by BFCL's own ``convert_to_tool`` as its
    OpenAI function-calling handler does (BFCL types mapped to JSON Schema, dots in names to ``_``)."""
    _require()
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool

    return convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)


def ast_check(
    functions: list[dict[str, Any]], decoded: list[dict[str, Any]], answer: list[Any], category: str
) -> dict[str, Any]:
    """BFCL's AST checker, called unchanged on ``decoded`` (``[{name: {arg: value}}]``, BFCL's decoded
    form): ``{"valid": bool, "error": [...], "error_type": "..."}``."""
    _require()
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker(functions, decoded, answer, Language.PYTHON, category, CHECKER_MODEL)


def execute(calls: list[str], case: dict[str, Any], run_name: str) -> list[str]:
    """BFCL's own executor (``execute_multi_turn_func_call``) on ``calls`` (``"name(arg=value)"``
    strings) against ``case``'s API classes, whose state lives under ``run_name`` (one per rollout:
    BFCL keeps instances in its module's globals by model name and case id)."""
    _require()
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call

    results, _ = execute_multi_turn_func_call(
        calls, case["initial_config"], case["involved_classes"], run_name, case["id"]
    )
    return results


def multi_turn_check(
    decoded: list[list[list[str]]], case: dict[str, Any], answer: list[list[str]], run_name: str
) -> dict[str, Any]:
    """BFCL's multi-turn checker, called unchanged: the model's calls per turn and step replayed on fresh
    instances and compared with the ground truth's state and results turn by turn."""
    _require()
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    if len(decoded) != len(answer):
        return {"valid": False, "error_type": "multi_turn:force_terminated"}
    try:
        return multi_turn_checker(decoded, answer, case, "multi_turn_base", run_name)
    finally:
        forget(run_name)


def forget(run_name: str) -> None:
    """Drop the API instances BFCL's executor kept for ``run_name`` (its module globals), so a long run
    does not keep every rollout's file system and a later rollout never sees an earlier one's state."""
    import re

    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    prefix = re.sub(r"[-./:]", "_", run_name)
    for key in [k for k in vars(multi_turn_utils) if k.startswith(prefix) and k.endswith("_instance")]:
        del vars(multi_turn_utils)[key]


def convert_to_calls(decoded: list[dict[str, Any]]) -> list[str]:
    """``[{name: args}]`` as BFCL's executable call strings (its ``convert_to_function_call``)."""
    _require()
    from bfcl_eval.model_handler.utils import convert_to_function_call

    return convert_to_function_call(decoded)
