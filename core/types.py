"""The data model every agl component shares (DESIGN §3).

One definition, used by every store, the store server, the HTTP client and the trainer, so the schema
never exists twice. Models validate at construction: a bad id, an unknown status or a NaN reward is
refused where it is made, not discovered later in a training batch.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Iterable
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "as_tasks",
    "ATTEMPT_STATUSES",
    "ROLLOUT_STATUSES",
    "TERMINAL_ROLLOUT_STATUSES",
    "Attempt",
    "AttemptError",
    "AttemptStatus",
    "Claim",
    "LLM",
    "Mode",
    "NewRollout",
    "PromptTemplate",
    "Resource",
    "Resources",
    "Rollout",
    "RolloutConfig",
    "RolloutStatus",
    "Span",
    "SpanEvent",
    "SpanStatus",
    "Task",
    "Transition",
    "new_id",
]

Mode = Literal["train", "val", "test"]
RolloutStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
AttemptStatus = Literal["running", "succeeded", "failed", "timed_out", "lost"]
ROLLOUT_STATUSES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_ROLLOUT_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
ATTEMPT_STATUSES: tuple[str, ...] = ("running", "succeeded", "failed", "timed_out", "lost")

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,127}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def new_id(prefix: str = "ro") -> str:
    """A short random id; the prefix tells a human what kind of thing it names."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _check_id(value: str, what: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(
            f"invalid {what} {value!r}: ids are 1-128 characters of letters, digits, '_', '.', ':' or '-', "
            "starting with a letter or digit"
        )
    return value


def _check_finite(value: float | None, what: str) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return value


def _check_json_finite(value: Any, what: str) -> Any:
    """Reject NaN/inf anywhere inside JSON-like data: they are not JSON and poison rewards."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{what} contains a non-finite number ({v!r})")
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return value


_INT_ONLY = {int}
_FLOAT_ONLY = {float}
_STR_BOOL = frozenset({str, bool})
_MIN_I64, _MAX_I64 = -(2**63), 2**63 - 1


def _check_attributes(v: dict[str, Any]) -> dict[str, Any]:
    """OTel attribute rules: non-empty string keys; str/bool/int/float values or lists of them; finite."""
    for key, value in v.items():
        if type(key) is not str or not key:
            raise ValueError(f"attribute keys must be non-empty strings, got {key!r}")
        kind = type(value)
        # Fast paths: exact scalar types, and long homogeneous lists (token ids, logprobs) checked in C.
        if kind is str or kind is bool:
            continue
        if kind is int:
            if _MIN_I64 <= value <= _MAX_I64:
                continue
        elif kind is float:
            if math.isfinite(value):
                continue
        items = value if isinstance(value, (list, tuple)) else [value]
        kinds = set(map(type, items))
        if kinds == _INT_ONLY:
            if _MIN_I64 <= min(items) and max(items) <= _MAX_I64:
                continue
        elif kinds == _FLOAT_ONLY:
            if all(map(math.isfinite, items)):
                continue
        elif kinds and kinds <= _STR_BOOL:
            continue
        for item in items:
            if item is None or not isinstance(item, (str, bool, int, float)):
                raise ValueError(
                    f"attribute {key!r} has a value of type {type(item).__name__}; OTel attributes are "
                    "str, bool, int, float or a list of them"
                )
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"attribute {key!r} is not finite ({item!r})")
            if isinstance(item, int) and not isinstance(item, bool) and not _MIN_I64 <= item <= _MAX_I64:
                raise ValueError(f"attribute {key!r} holds an integer outside 64 bits ({item!r})")
    return v


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _construct(cls: type, values: dict[str, Any]) -> Any:
    """Build a model from trusted, already-valid data without re-validating it (hot paths: a store
    reading its own rows, agl converting the spans its own tracer made).

    ``values`` must hold every field. This is what ``model_construct`` does, minus its per-field
    default handling, which costs more than the rest of a read. Untrusted input (what a store server
    receives) is validated as usual; this is for data agl made or checked itself.
    """
    obj = _new(cls)
    _setattr(obj, "__dict__", values)
    _set_fields_set(obj, set(values))
    _set_extra(obj, None)
    _set_private(obj, None)
    return obj


_new = object.__new__
_setattr = object.__setattr__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


# --------------------------------------------------------------------------------------------- tasks


class Task(_Model):
    id: str = Field(default_factory=lambda: new_id("task"))
    input: Any = None
    mode: Mode = "train"
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("id")
    @classmethod
    def _v_id(cls, v: str) -> str:
        return _check_id(v, "task id")

    @field_validator("input", "metadata")
    @classmethod
    def _v_json(cls, v: Any) -> Any:
        return _check_json_finite(v, "task data")


# ------------------------------------------------------------------------------------------ rollouts


class RolloutConfig(_Model):
    """How long a rollout may run and how often it is retried."""

    timeout_s: float | None = Field(default=None, gt=0)
    lease_s: float = Field(default=60.0, gt=0)
    max_attempts: int = Field(default=1, ge=1, le=100)

    @field_validator("timeout_s", "lease_s")
    @classmethod
    def _v_finite(cls, v: float | None) -> float | None:
        return _check_finite(v, "rollout config value")


class AttemptError(_Model):
    """Why an attempt failed: pass it as ``store.finish_attempt(..., "failed", error=...)``."""

    type: str
    message: str = ""
    traceback: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException) -> AttemptError:
        """The error of an exception, with its formatted traceback (what the Runner records)."""
        import traceback as tb

        return cls(
            type=type(exc).__qualname__,
            message=str(exc),
            traceback="".join(tb.format_exception(type(exc), exc, exc.__traceback__)),
        )


class Attempt(_Model):
    rollout_id: str
    number: int = Field(ge=1)
    worker_id: str | None = None
    status: AttemptStatus = "running"
    resources_version: int | None = None
    started_at: float = Field(default_factory=time.time)
    last_heartbeat: float = Field(default_factory=time.time)
    lease_expires_at: float | None = None
    ended_at: float | None = None
    error: AttemptError | None = None


class NewRollout(_Model):
    """What a caller asks the store to enqueue; the store turns it into a `Rollout`."""

    id: str | None = None
    task_id: str | None = None
    input: Any = None
    mode: Mode = "train"
    group_id: str | None = None
    resources_version: int | None = Field(default=None, ge=0, le=2**62)
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("id", "task_id", "group_id")
    @classmethod
    def _v_ids(cls, v: str | None) -> str | None:
        return None if v is None else _check_id(v, "id")

    @field_validator("input", "metadata")
    @classmethod
    def _v_json(cls, v: Any) -> Any:
        return _check_json_finite(v, "rollout data")

    @classmethod
    def from_task(cls, task: Task, **kw: Any) -> NewRollout:
        return cls(task_id=task.id, input=task.input, mode=task.mode, **kw)


class Rollout(_Model):
    id: str
    task_id: str | None = None
    input: Any = None
    mode: Mode = "train"
    group_id: str | None = None
    resources_version: int | None = None
    status: RolloutStatus = "queued"
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    ended_at: float | None = None
    attempts: tuple[Attempt, ...] = ()

    @field_validator("id")
    @classmethod
    def _v_id(cls, v: str) -> str:
        return _check_id(v, "rollout id")

    @property
    def latest_attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_ROLLOUT_STATUSES


class Claim(_Model):
    """A claimed rollout and the attempt (with its lease) the claim created."""

    rollout: Rollout
    attempt: Attempt


# --------------------------------------------------------------------------------------------- spans

AttrValue = Union[str, bool, int, float, list[str], list[bool], list[int], list[float]]


class SpanStatus(_Model):
    code: Literal["UNSET", "OK", "ERROR"] = "UNSET"
    message: str | None = None


class SpanEvent(_Model):
    name: str
    time_ns: int = Field(ge=0, le=2**63 - 1)
    attributes: dict[str, Any] = Field(default_factory=dict)

    @field_validator("attributes")
    @classmethod
    def _v_attrs(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_attributes(v)


class Span(_Model):
    """An OpenTelemetry span as the store keeps it, tagged with the rollout/attempt it belongs to."""

    trace_id: str
    span_id: str
    parent_id: str | None = None
    name: str = Field(min_length=1, max_length=1024)
    kind: Literal["INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER"] = "INTERNAL"
    start_ns: int = Field(ge=0, le=2**63 - 1)
    end_ns: int = Field(ge=0, le=2**63 - 1)
    status: SpanStatus = Field(default_factory=SpanStatus)
    attributes: dict[str, Any] = Field(default_factory=dict)
    events: tuple[SpanEvent, ...] = ()
    resource: dict[str, Any] = Field(default_factory=dict)
    rollout_id: str
    attempt: int = Field(ge=1, le=2**31)
    seq: int | None = None
    stale: bool = False

    @field_validator("trace_id")
    @classmethod
    def _v_trace(cls, v: str) -> str:
        if not isinstance(v, str) or not _HEX32.match(v) or v == "0" * 32:
            raise ValueError(f"invalid trace_id {v!r}: expected 32 lowercase hex digits, not all zero")
        return v

    @field_validator("span_id", "parent_id")
    @classmethod
    def _v_span(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not isinstance(v, str) or not _HEX16.match(v) or v == "0" * 16:
            raise ValueError(f"invalid span id {v!r}: expected 16 lowercase hex digits, not all zero")
        return v

    @field_validator("rollout_id")
    @classmethod
    def _v_rollout(cls, v: str) -> str:
        return _check_id(v, "rollout id")

    @field_validator("attributes", "resource")
    @classmethod
    def _v_attrs(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _check_attributes(v)

    @model_validator(mode="after")
    def _v_times(self) -> Span:
        if self.end_ns < self.start_ns:
            raise ValueError(f"span {self.span_id} ends ({self.end_ns}) before it starts ({self.start_ns})")
        return self

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


# ----------------------------------------------------------------------------------------- resources


class LLM(_Model):
    type: Literal["llm"] = "llm"
    base_url: str
    model: str
    sampling: dict[str, Any] = Field(default_factory=dict)
    api_key: str | None = None

    @field_validator("sampling")
    @classmethod
    def _v_json(cls, v: Any) -> Any:
        return _check_json_finite(v, "sampling parameters")


class PromptTemplate(_Model):
    type: Literal["prompt_template"] = "prompt_template"
    template: str
    engine: Literal["f-string", "jinja"] = "f-string"

    def format(self, **kwargs: Any) -> str:
        if self.engine == "f-string":
            return self.template.format(**kwargs)
        import jinja2

        return jinja2.Template(self.template).render(**kwargs)


Resource = Annotated[Union[LLM, PromptTemplate], Field(discriminator="type")]


class Resources(_Model):
    """A versioned snapshot of what agents use: the LLM endpoint (and model version) and prompts."""

    version: int = Field(ge=0)
    items: dict[str, Resource] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)

    @property
    def llm(self) -> LLM | None:
        """The main LLM: the one named "main", else the first one."""
        llms = [r for r in self.items.values() if isinstance(r, LLM)]
        main = self.items.get("main")
        return main if isinstance(main, LLM) else (llms[0] if llms else None)

    @property
    def prompts(self) -> dict[str, PromptTemplate]:
        """The prompt templates of the snapshot by name (``resources.prompts["writer"]``)."""
        return {k: v for k, v in self.items.items() if isinstance(v, PromptTemplate)}


# --------------------------------------------------------------------------------------- transitions


class Transition(_Model):
    """One LLM call turned into a training sample: the paper's (state, action, reward) triplet.

    ``reward`` holds the call's *credited return* ``G_j`` (:mod:`agl.adapter.credit`), not a raw reward:
    the rollout's ``final_reward`` and this call's ``intermediate_reward`` (emitted and AIR rewards)
    combined under the run's credit rule (``identical``: ``G_j = R + r_j``), which the update
    normalises into advantages.
    """

    rollout_id: str
    attempt: int = Field(ge=1)
    group_id: str | None = None
    agent: str | None = None
    index: int = Field(ge=0)
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...] | None = None
    messages: tuple[dict[str, Any], ...] = ()
    response_text: str | None = None
    reward: float = 0.0
    intermediate_reward: float = 0.0
    final_reward: float = 0.0
    exact: bool = True
    span_id: str | None = None
    model: str | None = None
    weight_version: int | None = None
    #: the weights that drew the response tokens, run-length ``((version, n_tokens), ...)`` in token
    #: order (several runs: weights swapped during the call); ``weight_version`` is the oldest of them
    weight_versions: tuple[tuple[int, int], ...] | None = None
    #: the engine stopped the response at ``max_tokens`` (finish reason ``length``): an unfinished answer,
    #: which ``UpdateSettings.mask_truncated`` leaves out of the loss (DAPO's overlong filtering)
    truncated: bool = False
    #: the seed the engine sampled the call with (the span's ``agl.llm.seed``) and where it came from:
    #: "run" (derived from the run's seed and the call's place, agl.gateway.seeds) or "agent" (the program's own)
    seed: int | None = None
    seed_source: str | None = None
    #: how the rollout's attempt ended (agl.adapter.failures.failure_kind): "task" (finished with a
    #: reward), "no_reward", "agent" (its own code failed) or "infra" (never trained on); None: not known
    failure_kind: Literal["infra", "agent", "task", "no_reward"] | None = None
    #: the app threw the call's output away (an input guardrail tripped during the agent's turn: the
    #: span's ``agl.discarded.windows``); the adapter leaves such calls out unless ``keep_discarded=True``
    discarded: bool = False

    @field_validator("reward", "intermediate_reward", "final_reward")
    @classmethod
    def _v_finite(cls, v: float) -> float:
        return _check_finite(v, "reward")  # type: ignore[return-value]

    @field_validator("response_logprobs")
    @classmethod
    def _v_logprobs(cls, v: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if v is not None:
            for x in v:
                if not math.isfinite(x):
                    raise ValueError("response_logprobs must be finite")
        return v

    @model_validator(mode="after")
    def _v_lengths(self) -> Transition:
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"response_logprobs has {len(self.response_logprobs)} entries for "
                f"{len(self.response_ids)} response tokens"
            )
        return self


def as_tasks(data: Iterable[Any] | None, mode: Literal["train", "val", "test"]) -> list[Task]:
    """Task inputs (or ``Task`` objects, copied with ``mode``) as tasks of ``mode``, numbered
    ``{mode}-{i}`` when new: how the trainer, APO and ``dev`` turn a dataset into tasks."""
    tasks: list[Task] = []
    for i, item in enumerate(data or []):
        if isinstance(item, Task):
            tasks.append(item.model_copy(update={"mode": mode}))
        else:
            tasks.append(Task(id=f"{mode}-{i}", input=item, mode=mode))
    return tasks
