"""A served adapter is proven, not assumed: the checks that the engine serves the weights the trainer
published (issue 36; ART #661 is a stale adapter served silently).

- After each push the gateway's reported weight version must equal the one the trainer pushed
  (:func:`prove_push`): the in-process backend's ``weight_version``, or an external gateway's reply
  to the push and its ``/agl/v1/status``. A mismatch fails the step with both versions named.
- A trained call must have been served by a version the trainer published (:func:`prove_calls`; the
  asynchronous loop's :class:`agl.trainer.pipeline.VersionLedger` does the same per group). A call served
  by any other version means another writer pushed to the engine, or the engine reloaded old weights.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

from agl.types import Transition

__all__ = ["prove_calls", "prove_push"]


def prove_push(reported: Any, pushed: int, where: str) -> None:
    """Raise unless ``reported`` (the version ``where`` says it serves) is ``pushed``."""
    if isinstance(reported, bool) or not isinstance(reported, int) or reported != pushed:
        raise RuntimeError(
            f"the trainer pushed weight version {pushed}, but {where} reports version {reported!r}: "
            "the engine does not serve the weights this trainer published"
        )


def prove_calls(transitions: Iterable[Transition], published: Container[int], what: str) -> None:
    """Raise when a call in ``transitions`` was served by a recorded weight version not in ``published``
    (calls without a recorded version are not judged here)."""
    bad = sorted(
        {
            t.weight_version
            for t in transitions
            if t.weight_version is not None and t.weight_version not in published
        }
    )
    if bad:
        raise RuntimeError(
            f"{what}: calls were served by weight version(s) {bad}, which this trainer did not publish "
            f"(it published {_shown(published)}): another writer pushed to the engine, or it reloaded old weights"
        )


def _shown(published: Container[int]) -> str:
    if isinstance(published, (set, frozenset, list, tuple, dict)):
        return str(sorted(published))
    return repr(published)
