"""Compare two runs call by call: where they first part, and why (``agl diff RUN_A RUN_B``).

A run is a store (every rollout, its spans) and, for a run directory, its ``metrics.jsonl``. Rollouts
are matched by their *place* in the run (:data:`agl.semconv.ROLLOUT_PLACE_KEY`, which the trainer writes
with the rollout's seed, :mod:`agl.gateway.seeds`), never by id (ids are random) or by when they ran; rollouts
without a place (enqueued by hand) are matched by their position among those of the same step and mode
in store order. Within a matched pair, the LLM calls of each rollout's finishing attempt are matched by
their index in the attempt (``agl.llm.call_index``, else store order).

The first divergence is the first matched call, in run order (step, then place, then call), whose
prompt or response token ids differ, or whose tokens match but whose log-probs do not (the update
weighs each token by its behaviour log-prob, so those runs' weights part too), or the first rollout that exists in one run only, made a different
number of calls, or got a different final reward from the same calls. Its likely reason, in the order
checked: a different task at that place (the runs' seeds or task lists differ), a different prompt (then the difference is upstream: the program, the task, an earlier reply
it quoted), a different seed, a different weights version; with the same prompt, seed and version the
weights themselves or the engine's numerics differ (an earlier update that parted, or batching:
``deterministic=True``). For run directories the first step whose deterministic metrics differ is
reported too (timings are left out: they always differ). :func:`diff_rollout` compares one rollout with
the rollout at its place in the other run, with the same matching and reasons: the dashboard's view
(``agl dashboard --compare RUN``, :mod:`agl.dashboard.compare`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agl import semconv as sc
from agl.errors import UsageError
from agl.types import TERMINAL_ROLLOUT_STATUSES

__all__ = [
    "CallView",
    "Divergence",
    "RunDiff",
    "diff_rollout",
    "diff_runs",
    "first_difference",
    "keyed_rollouts",
    "open_run",
    "read_metrics",
]

#: metrics left out of the comparison: timings, throughput and memory differ on every run
_UNSTABLE = re.compile(r"(_s$|_per_s|share|busy|rss|mem|time|wall|speed|throughput|_at$)")


@dataclass
class CallView:
    """One LLM call as recorded on its gateway span."""

    rollout_id: str
    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    #: the engine's log-prob of each response token (the behaviour policy the update corrects for)
    logprobs: list[float] | None = None
    seed: int | None = None
    seed_source: str | None = None
    weight_version: int | None = None
    span_id: str | None = None


@dataclass
class Divergence:
    """Where two runs first part: the step, the rollout's place, the call (None: the rollout itself)."""

    step: int | None
    place: str
    call: int | None
    reason: str
    a: CallView | None = None
    b: CallView | None = None
    #: the index of the first token that differs in the responses (None: the prompts differ, or no call)
    first_token: int | None = None


@dataclass
class RunDiff:
    """The comparison: identical, or where and why the runs first part."""

    rollouts: int = 0
    calls: int = 0
    first: Divergence | None = None
    #: the first step whose deterministic metrics differ: (step, metric, value in A, value in B)
    metrics: tuple[int, str, Any, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.first is None and self.metrics is None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["identical"] = self.identical
        return out


@dataclass
class Run:
    """A run opened for comparison: its store and, when known, its metrics records."""

    label: str
    store: Any
    metrics: list[dict[str, Any]] | None = None


def open_run(spec: str) -> Run:
    """A run directory (``store.db`` inside, ``metrics.jsonl`` beside it), a SQLite file or a store URL."""
    import agl.store

    path = Path(spec)
    if path.is_dir():
        db = path / "store.db"
        if not db.exists():
            raise UsageError(f"{spec}: a run directory without store.db (pass its store URL instead)")
        return Run(spec, agl.store.open(f"sqlite:///{db.resolve()}"), read_metrics(path / "metrics.jsonl"))
    if "://" in spec:
        return Run(spec, agl.store.open(spec))
    if path.is_file():
        return Run(spec, agl.store.open(f"sqlite:///{path.resolve()}"))
    raise UsageError(f"{spec}: no such run directory, store file or store URL")


def read_metrics(path: Path) -> list[dict[str, Any]] | None:
    """A ``metrics.jsonl``'s records (None: no such file); a torn last line is skipped."""
    if not path.exists():
        return None
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
    return out


def _natural(text: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def _placed_key(rollout: Any) -> tuple[Any, ...] | None:
    """A rollout's run-order key from its own metadata: (step, natural sort of place, place); None
    for a rollout without a place (its key depends on the other rollouts of its step and mode)."""
    place = rollout.metadata.get(sc.ROLLOUT_PLACE_KEY)
    if not isinstance(place, str):
        return None
    step = rollout.metadata.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else -1
    return (step, _natural(place), place)


def keyed_rollouts(store: Any) -> dict[tuple[Any, ...], Any]:
    """The store's rollouts by their run-order key (step, natural sort of place, place), sorted."""
    return _keyed(store)


def _keyed(store: Any) -> dict[tuple[Any, ...], Any]:
    """The store's rollouts by their sort key in run order: (step, mode, place)."""
    out: dict[tuple[Any, ...], Any] = {}
    unplaced: dict[tuple[Any, str], int] = {}
    for r in store.query_rollouts():
        key = _placed_key(r)
        if key is None:
            step = r.metadata.get("step")
            step = step if isinstance(step, int) and not isinstance(step, bool) else -1
            n = unplaced.get((step, r.mode), 0)
            unplaced[(step, r.mode)] = n + 1
            place = f"{r.mode}:#{n}"
            key = (step, _natural(place), place)
        out[key] = r
    return dict(sorted(out.items(), key=lambda kv: kv[0][:2]))


def _calls(store: Any, rollout: Any) -> list[CallView]:
    """The LLM calls of the rollout's finishing attempt, in call order (gateway spans with token ids)."""
    from agl.adapter import finishing_attempt

    attempt = finishing_attempt(rollout)
    if attempt is None:
        return []
    spans = store.query_spans(rollout_id=rollout.id, attempt=attempt, include_stale=False)
    calls: list[tuple[tuple[int, int], CallView]] = []
    for pos, s in enumerate(spans):
        a = s.attributes
        if a.get(sc.AGL_SIDE) != sc.SIDE_SERVER or sc.AGL_LLM_RESPONSE_TOKEN_IDS not in a:
            continue
        index = a.get(sc.AGL_LLM_CALL_INDEX)
        key = (index if isinstance(index, int) else pos, int(a.get(sc.AGL_LLM_CHOICE_INDEX) or 0))
        view = CallView(
            rollout_id=rollout.id,
            index=len(calls),
            prompt_ids=list(a.get(sc.AGL_LLM_PROMPT_TOKEN_IDS) or []),
            response_ids=list(a.get(sc.AGL_LLM_RESPONSE_TOKEN_IDS) or []),
            logprobs=a.get(sc.AGL_LLM_RESPONSE_LOGPROBS),
            seed=a.get(sc.AGL_LLM_SEED),
            seed_source=a.get(sc.AGL_LLM_SEED_SOURCE),
            weight_version=a.get(sc.AGL_LLM_WEIGHT_VERSION),
            span_id=s.span_id,
        )
        calls.append((key, view))
    calls.sort(key=lambda kv: kv[0])
    for i, (_, view) in enumerate(calls):
        view.index = i
    return [v for _, v in calls]


def first_difference(x: list[int], y: list[int]) -> int | None:
    for i, (p, q) in enumerate(zip(x, y, strict=False)):
        if p != q:
            return i
    return None if len(x) == len(y) else min(len(x), len(y))


def _cut(value: Any, width: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def _reason(a: CallView, b: CallView) -> str:
    if a.prompt_ids != b.prompt_ids:
        return (
            "different prompt: the program saw something else (the task, a tool's result, or an earlier "
            "reply of this rollout it quoted)"
        )
    if a.seed != b.seed:
        return f"different seed: A {a.seed} ({a.seed_source}), B {b.seed} ({b.seed_source})"
    if a.weight_version != b.weight_version:
        return f"different weights version: A v{a.weight_version}, B v{b.weight_version}"
    if a.seed is None:
        return (
            "no seed on either call: the engine drew from an unseeded generator (run the trainer with a seed)"
        )
    return (
        "same prompt, seed and weights version: the weights themselves differ (an earlier update parted: "
        "see the metrics) or the engine's numerics do (batching: run with deterministic=True; another "
        "machine, thread count or backend)"
    )


def _compare_rollout(
    key: tuple[Any, ...], ra: Any, rb: Any, a: Run, b: Run, out: RunDiff
) -> Divergence | None:
    step, place = (key[0] if key[0] >= 0 else None), key[2]
    if ra.input != rb.input:
        sa, sb = ra.metadata.get(sc.ROLLOUT_SEED_KEY), rb.metadata.get(sc.ROLLOUT_SEED_KEY)
        why = "the runs' seeds differ" if sa != sb else "the task lists differ"
        return Divergence(
            step, place, None, f"different task at this place: A {_cut(ra.input)}, B {_cut(rb.input)} ({why})"
        )
    ca, cb = _calls(a.store, ra), _calls(b.store, rb)
    out.rollouts += 1
    for x, y in zip(ca, cb, strict=False):
        out.calls += 1
        if x.prompt_ids != y.prompt_ids or x.response_ids != y.response_ids:
            first = None if x.prompt_ids != y.prompt_ids else first_difference(x.response_ids, y.response_ids)
            return Divergence(step, place, x.index, _reason(x, y), x, y, first)
        if x.logprobs != y.logprobs and x.logprobs is not None and y.logprobs is not None:
            i = next((k for k, (p, q) in enumerate(zip(x.logprobs, y.logprobs, strict=False)) if p != q), 0)
            why = (
                f"same tokens, different log-probs (token {i}: A {x.logprobs[i]!r}, B {y.logprobs[i]!r}): the "
                "engine's numerics (batching: deterministic=True); the update weighs by them, so weights part"
            )
            return Divergence(step, place, x.index, why, x, y, i)
    if len(ca) != len(cb):
        return Divergence(
            step,
            place,
            min(len(ca), len(cb)),
            f"A made {len(ca)} LLM call(s), B {len(cb)}: the program "
            "took another path on the same replies (its own randomness, a tool, a timeout)",
        )
    from agl.reports.inspect import final_reward_of

    wa, wb = final_reward_of(a.store, ra), final_reward_of(b.store, rb)
    if wa != wb and not (isinstance(wa, float) and isinstance(wb, float) and math.isclose(wa, wb)):
        return Divergence(
            step,
            place,
            None,
            f"same calls, different final reward: A {wa}, B {wb} (the reward is not deterministic)",
        )
    return None


def _compare_metrics(ma: list[dict[str, Any]], mb: list[dict[str, Any]]) -> tuple[int, str, Any, Any] | None:
    by_a = {r.get("step"): r for r in ma if isinstance(r.get("step"), int)}
    by_b = {r.get("step"): r for r in mb if isinstance(r.get("step"), int)}
    for step in sorted(set(by_a) | set(by_b)):
        ra, rb = by_a.get(step), by_b.get(step)
        if ra is None or rb is None:
            return step, "(step)", ra is not None, rb is not None
        for k in sorted(set(ra) | set(rb)):
            if _UNSTABLE.search(k):
                continue
            va, vb = ra.get(k), rb.get(k)
            if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and not isinstance(va, bool):
                if va != vb and not (math.isnan(va) and math.isnan(vb)):
                    return step, k, va, vb
            elif va != vb and not isinstance(va, (dict, list)):
                return step, k, va, vb
    return None


def diff_rollout(
    a: Run, b: Run, rollout_id: str, *, b_keyed: dict[tuple[Any, ...], Any] | None = None
) -> tuple[RunDiff, Any, Any]:
    """Compare one rollout of ``a`` with the rollout at the same place in ``b`` (the dashboard's view).

    The same matching and reasons as :func:`diff_runs`, for one pair: returns the comparison (``first``
    is None when the pair is identical), A's rollout and B's (None: B has nothing at that place).
    ``b_keyed`` is :func:`keyed_rollouts` of ``b`` when the caller keeps it; a stale one is fine (a
    key it lacks is looked up afresh). Raises the store's NotFoundError for an unknown ``rollout_id``.
    """
    out = RunDiff()
    ra = a.store.get_rollout(rollout_id)
    key = _placed_key(ra)
    if key is None:  # matched by position among its step's and mode's unplaced rollouts
        key = next((k for k, r in _keyed(a.store).items() if r.id == ra.id), None)
        if key is None:  # pragma: no cover - the store just returned it
            raise UsageError(f"rollout {rollout_id!r} is not in run A")
    keyed = b_keyed if b_keyed is not None and key in b_keyed else _keyed(b.store)
    rb = keyed.get(key)
    step = key[0] if key[0] >= 0 else None
    if ra.status not in TERMINAL_ROLLOUT_STATUSES:
        out.notes.append(f"rollout {ra.id} is still {ra.status}: its calls so far are compared")
    if rb is None:
        out.first = Divergence(step, key[2], None, "rollout only in A: the runs enqueued different work")
        return out, ra, None
    rb = b.store.get_rollout(rb.id)  # a cached one may have finished since
    out.first = _compare_rollout(key, ra, rb, a, b, out)
    return out, ra, rb


def diff_runs(a: Run, b: Run) -> RunDiff:
    """Compare runs ``a`` and ``b`` (see the module docstring)."""
    out = RunDiff()
    ka, kb = _keyed(a.store), _keyed(b.store)
    keys = sorted(set(ka) | set(kb), key=lambda k: k[:2])
    if not keys:
        out.notes.append("neither run has any rollout")
    for key in keys:
        ra, rb = ka.get(key), kb.get(key)
        step = key[0] if key[0] >= 0 else None
        if ra is None or rb is None:
            which = "A" if ra is not None else "B"
            out.first = Divergence(
                step, key[2], None, f"rollout only in {which}: the runs enqueued different work"
            )
            break
        div = _compare_rollout(key, ra, rb, a, b, out)
        if div is not None:
            out.first = div
            break
    if a.metrics is not None and b.metrics is not None:
        out.metrics = _compare_metrics(a.metrics, b.metrics)
    return out
