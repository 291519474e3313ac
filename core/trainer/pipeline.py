"""``GroupPipeline``: the store-side half of asynchronous training (``LoopConfig.max_staleness > 0``).

The trainer keeps up to ``budget`` GRPO groups *outstanding* in the store (queued, running, or
finished but not yet trained on), so runners always have work while the policy updates. An update
takes the next groups that are complete (every rollout terminal) **in completion order** (the last
rollout's ``ended_at``), never in enqueue order, so a slow group does not hold the batch back.

Staleness is read from the data, not assumed: every call's served weight version is on its gateway
span (``agl.llm.weight_version``), carried on :class:`agl.types.Transition`. A group's staleness is
how many policy updates its oldest call's weights are behind the update about to train on it
(:class:`VersionLedger`); a group older than ``max_staleness``, or one with a call whose lag cannot
be proven, is *consumed as dropped*.

What holds for resume: a group id is *consumed* (trained or dropped) exactly once; the consumed ids are
saved with each checkpoint (:meth:`state`), and :meth:`restore` rebuilds the outstanding groups from
the store, so groups finished while the trainer was down are trained, and rollouts a killed runner
held are retried by the store when their lease lapses.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl import semconv as sc
from agl.errors import ConflictError, NotFoundError
from agl.gateway.seeds import rollout_seed
from agl.types import NewRollout, Rollout, Task, Transition

log = logging.getLogger("agl.trainer")


def cancel_rollouts(store: Any, ids: Sequence[str]) -> int:
    """Cancel each rollout (the Trainer no longer wants it); returns how many were cancelled. A rollout
    that finished meanwhile (the store's conflict) or is gone (not found) is skipped; any other failure
    (a dead store server) is logged, not swallowed, and the rest are still tried."""
    n = 0
    for rid in ids:
        try:
            store.cancel(rid)
        except (ConflictError, NotFoundError):
            continue
        except Exception as exc:  # noqa: BLE001 - one failed cancel must not stop the others; said loudly
            log.warning("agl trainer: could not cancel rollout %s: %s: %s", rid, type(exc).__name__, exc)
            continue
        n += 1
    return n


__all__ = [
    "Group",
    "GroupPipeline",
    "PIPELINE_KEY",
    "REQUEUED_FROM_KEY",
    "VersionLedger",
    "group_lag",
    "wait_for_groups",
]

#: the rollout metadata key that marks a rollout as the pipeline's (so a resumed run finds its groups)
PIPELINE_KEY = "pipeline"
#: a requeued rollout's metadata: the id of the rollout, failed on the infrastructure, whose place it takes
REQUEUED_FROM_KEY = "agl.requeued_from"


@dataclass
class Group:
    """One GRPO group in flight: its rollout ids and, once each is terminal, its transitions/reward."""

    group_id: str
    ids: list[str]
    transitions: dict[str, list[Transition]] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)
    finished: dict[str, Rollout] = field(default_factory=dict)
    #: members that failed on the infrastructure and were requeued (their places now hold the new ids)
    replaced: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.ids)

    @property
    def ended_at(self) -> float:
        """When the group completed: its last rollout's end (the order an update takes groups in)."""
        return max((r.ended_at or r.updated_at) for r in self.finished.values())

    def all_transitions(self) -> list[Transition]:
        return [t for rid in self.ids for t in self.transitions.get(rid, [])]


#: adapt one terminal rollout: its transitions and its reward (None: no reward, e.g. cancelled)
Adapt = Callable[[Rollout], "tuple[list[Transition], float | None]"]
#: requeue one terminal rollout that failed on the infrastructure: its replacement's id, else None
Retry = Callable[[Rollout], "str | None"]


class GroupPipeline:
    """The outstanding groups of an asynchronous run and the ones already consumed."""

    def __init__(
        self,
        store: Any,
        adapt: Adapt,
        group_size: int,
        rollout_config: Any,
        seed: int | None = None,
        retry: Retry | None = None,
    ) -> None:
        self.store = store
        #: requeues a member that failed on the infrastructure (``Steps.retry``); None: never
        self.retry = retry
        #: the run's seed: each group's rollouts get seeds from it and the group's serial number (the
        #: n-th group enqueued takes the n-th task of the seeded order, whatever the timing; agl.gateway.seeds)
        self.seed = seed
        self.serial = 0
        self.adapt = adapt
        self.group_size = group_size
        self.rollout_config = rollout_config
        #: groups not yet consumed, in enqueue order
        self.outstanding: dict[str, Group] = {}
        #: group ids trained on or dropped (saved with every checkpoint)
        self.consumed: list[str] = []

    # ---------------------------------------------------------------------------- enqueue
    def enqueue(self, tasks: Sequence[Task], step: int) -> list[Group]:
        """``group_size`` rollouts of each task, one new group each. Not pinned to a resources version:
        each attempt runs with the latest one, so a rollout retried after the trainer restarted reaches
        the new gateway (a pinned version would name the dead process's URL)."""
        made: list[Group] = []
        rollouts: list[NewRollout] = []
        for task in tasks:
            gid = f"{task.id}-g{uuid.uuid4().hex[:10]}"
            batch = [
                NewRollout.from_task(
                    task,
                    group_id=gid,
                    config=self.rollout_config,
                    metadata={"step": step, PIPELINE_KEY: True, **self._seeded(member)},
                )
                for member in range(self.group_size)
            ]
            self.serial += 1
            rollouts.extend(batch)
            made.append(Group(gid, []))
        by_gid = {g.group_id: g for g in made}
        for r in self.store.enqueue(rollouts) if rollouts else []:
            by_gid[r.group_id or ""].ids.append(r.id)
        self.outstanding.update(by_gid)
        return made

    def _seeded(self, member: int) -> dict[str, Any]:
        """The seed and place of member ``member`` of the group about to be enqueued (none unseeded)."""
        if self.seed is None:
            return {}
        place = f"train:g{self.serial}/m{member}"
        return {sc.ROLLOUT_SEED_KEY: rollout_seed(self.seed, place), sc.ROLLOUT_PLACE_KEY: place}

    def fill(self, budget: int, step: int, draw: Callable[[int], list[Task]]) -> int:
        """Enqueue fresh groups until ``budget`` are outstanding; returns how many were added."""
        missing = budget - len(self.outstanding)
        if missing > 0:
            self.enqueue(draw(missing), step)
        return max(missing, 0)

    # ------------------------------------------------------------------------------- poll
    def poll(self, timeout_s: float = 0.2) -> None:
        """Adapt every outstanding rollout that has become terminal (waiting up to ``timeout_s``). A
        member that failed on the infrastructure and is requeued (``retry``) gives its place in the
        group to its replacement: the group completes when the replacement ends."""
        pending = [rid for g in self.outstanding.values() for rid in g.ids if rid not in g.finished]
        if not pending:
            return
        by_id = {rid: g for g in self.outstanding.values() for rid in g.ids}
        for r in self.store.wait_for_rollouts(pending, timeout_s=timeout_s):
            g = by_id.get(r.id)
            if g is None or r.id in g.finished or r.id not in g.ids:
                continue
            ts, reward = self.adapt(r)
            again = self.retry(r) if self.retry is not None else None
            if again is not None:
                g.ids[g.ids.index(r.id)] = again
                g.replaced.append(r.id)
                continue
            g.transitions[r.id] = ts
            if reward is not None:
                g.rewards[r.id] = reward
            g.finished[r.id] = r

    def completed(self) -> list[Group]:
        """The outstanding groups that are complete, in completion order."""
        return sorted((g for g in self.outstanding.values() if g.complete), key=lambda g: g.ended_at)

    def consume(self, group: Group) -> None:
        """Mark ``group`` trained on or dropped: it is never handed out again, even after a resume."""
        self.outstanding.pop(group.group_id, None)
        self.consumed.append(group.group_id)

    def cancel_outstanding(self) -> None:
        """Cancel the outstanding groups' unfinished rollouts (the run is over)."""
        self.cancel_unfinished(list(self.outstanding.values()))

    def cancel_unfinished(self, groups: Sequence[Group]) -> int:
        """Cancel the unfinished rollouts of ``groups``; returns how many it asked to cancel. A
        cancelled rollout ends its attempt, so its group completes without it."""
        ids = [rid for g in groups for rid in g.ids if rid not in g.finished]
        cancel_rollouts(self.store, ids)
        return len(ids)

    # ----------------------------------------------------------------------------- resume
    def state(self) -> dict[str, Any]:
        return {"consumed_groups": list(self.consumed)}

    def restore(self, state: dict[str, Any]) -> int:
        """The consumed group ids from a checkpoint's ``state``, and every other pipeline group in the
        store as outstanding (in enqueue order); returns how many groups were restored."""
        self.consumed = list(state.get("consumed_groups", []))
        done = set(self.consumed)
        self.outstanding.clear()
        rows = [
            r
            for r in self.store.query_rollouts(mode="train")
            if r.metadata.get(PIPELINE_KEY) and r.group_id is not None and r.group_id not in done
        ]
        # a member requeued before the kill gave its place to its replacement: only that one counts
        replaced = {r.metadata.get(REQUEUED_FROM_KEY) for r in rows} - {None}
        for r in rows:
            group = self.outstanding.setdefault(str(r.group_id), Group(str(r.group_id), []))
            (group.replaced if r.id in replaced else group.ids).append(r.id)
        self.serial = len(self.consumed) + len(self.outstanding)
        return len(self.outstanding)


class VersionLedger:
    """Which policy update (the policy's ``global_step``) each pushed weight version holds, so staleness
    counts updates, not published versions: a resumed run publishes a new version for the weights
    it reloaded, and a call served by the killed run's last push holds those same weights.

    Saved with every checkpoint. A version newer than every saved one was pushed by a killed run after
    its last checkpoint: its weights are the checkpoint's (``resumed_update``). A call without a
    recorded version (its gateway span lost with a killed process) has no provable lag (None); a call
    served by any other version the ledger does not know was served by weights this trainer never
    published, and fails the step (``RuntimeError``, :mod:`agl.run.served`)."""

    def __init__(self) -> None:
        self.updates: dict[int, int] = {}
        self.resumed_update: int | None = None

    def pushed(self, version: int, update: int) -> None:
        """Record that ``version`` holds the weights after ``update`` updates. The first push after a
        resume also records what every version the killed run pushed after its last checkpoint held
        (those between the saved ones and this one: the checkpoint's weights), so the next checkpoint
        saves them: a call they served, still untrained when this run is killed in turn, has a known
        lag after the next resume too (``resumed_update`` then names a later checkpoint)."""
        if self.resumed_update is not None and version > self._saved_max and not self._bridged:
            for v in range(self._saved_max + 1, version):
                self.updates.setdefault(v, self.resumed_update)
            self._bridged = True
        self.updates[version] = update

    def lag(self, version: int | None, current: int) -> int | None:
        """How many updates the weights of ``version`` are behind those of ``current`` (just pushed)."""
        if version is None:
            return None
        if version > current:
            raise RuntimeError(
                f"a call was served by weight version {version}, newer than the trainer's {current}: "
                "the engine serves weights this trainer did not publish"
            )
        held = self.updates.get(version)
        if held is None and self.resumed_update is not None and version > self._saved_max:
            held = self.resumed_update
        if held is None:
            raise RuntimeError(
                f"a call was served by weight version {version}, which this trainer did not publish "
                f"(it published {sorted(self.updates)}; current {current}): another writer pushed to the "
                "engine, or it reloaded old weights"
            )
        return self.updates[current] - held

    def state(self) -> dict[str, Any]:
        return {"version_updates": {str(v): u for v, u in self.updates.items()}}

    def restore(self, state: dict[str, Any], resumed_update: int) -> None:
        self.updates = {int(v): int(u) for v, u in state.get("version_updates", {}).items()}
        self._saved_max = max(self.updates, default=-1)
        self.resumed_update = resumed_update
        self._bridged = False

    _saved_max = -1
    _bridged = False


def group_lag(group: Group, ledger: VersionLedger, current: int) -> int | None:
    """The largest lag (in updates) of ``group``'s calls behind version ``current``; None when a call's
    lag cannot be proven. A group without transitions (every rollout failed) lags 0."""
    lags = [ledger.lag(t.weight_version, current) for t in group.all_transitions()]
    if any(x is None for x in lags):
        return None
    return max((x for x in lags if x is not None), default=0)


def wait_for_groups(
    pipe: GroupPipeline,
    want: int,
    accept: Callable[[Group], bool],
    on_drop: Callable[[Group], None],
    timeout_s: float | None = None,
) -> list[Group]:
    """The next ``want`` complete groups that ``accept`` keeps, in completion order; each group it
    refuses is consumed and handed to ``on_drop`` (which may enqueue a replacement). After waiting
    ``timeout_s`` (``LoopConfig.step_timeout_s``), the unfinished rollouts of the oldest outstanding
    groups it still needs are cancelled, so those groups complete with the rollouts that finished (the
    groups enqueued ahead keep running)."""
    taken: list[Group] = []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(taken) < want:
        for g in pipe.completed():
            if len(taken) == want:
                break
            pipe.consume(g)
            if accept(g):
                taken.append(g)
            else:
                on_drop(g)
        if len(taken) < want:
            if not pipe.outstanding:
                raise RuntimeError("the pipeline ran dry: no outstanding group left to wait for")
            if deadline is not None and time.monotonic() > deadline:
                late = list(pipe.outstanding.values())[: want - len(taken)]
                n = pipe.cancel_unfinished(late)
                log.warning("agl trainer: %d rollouts did not finish within step_timeout_s; cancelled", n)
                deadline = None
            pipe.poll()
    return taken
