"""The policy update on a Tinker-API service: :class:`TinkerPolicy`, what ``Trainer.build_policy``
makes for ``Serving(backend="tinker")`` in place of the local :class:`~agl.algorithms.update.PolicyUpdate`.

Each step's transitions become the service's data, one ``Datum`` per sequence: an agent conversation
whose calls extend one another exactly is one sequence (``merge_turns``, :mod:`agl.adapter.trajectories`,
kept whole), otherwise one per call. A datum carries the exact ids the gateway recorded
(``model_input`` = the sequence but its last token, ``target_tokens`` = the sequence shifted by one),
the behaviour log-probs the sampler returned (``logprobs``) and a per-token advantage: the call's
LightningRL advantage times its loss-balance factor (:mod:`agl.algorithms.balance`) on the model's own
tokens, 0 on the prompt, on tool results and on calls left out of the update (zero advantage, or cut
at ``max_tokens`` with ``mask_truncated``). The data go with ``loss_fn="ppo"`` (agl's update is PPO-clip:
:mod:`agl.algorithms.update`), then ``optim_step`` with the run's learning rate (Adam with torch's
AdamW defaults, as the local optimizer; ``grad_clip_norm`` = ``max_grad_norm`` where the SDK has it),
``epochs_per_step`` times.

The loss's scale is agl's token mean over the step's trained tokens, whatever the service's reduction:
Tinker sums a datum's per-token losses, so each advantage is divided by the step's trained token count;
skyrl-tx averages each datum over its ``weights`` and then over the data, so ``weights`` carry the loss
mask and each advantage is multiplied by ``data * mask_tokens(datum) / trained_tokens``. Either way the
gradient is the one the local update takes on the same transitions.

What the service's losses cannot express, refused by name before anything runs
(:func:`check_settings`): full fine-tuning (``lora=False``: the services train LoRA adapters), a KL
term (``kl_coef``), a temperature other than 1 (the service scores at temperature 1), decoupled PPO
(``off_policy="tis"``: it needs a proximal forward per step), a LoRA alpha other than the services'
32, and on skyrl-tx a clip range other than 0.2 (its ``ppo`` clips at [0.8, 1.2]; Tinker takes
``clip_low_threshold``/``clip_high_threshold``). Local-only settings have no effect here and say so
once: micro-batch packing and shared-prefix trees (the service packs), gradient checkpointing, mixed
precision.

Shapes: a JAX service compiles once per request shape (about a minute each on a CPU). On skyrl-tx the
number of data of a ``forward_backward`` is padded to a multiple of :data:`DATA_BUCKET` with data whose
weights are all zero (they change no gradient: the scale above counts them), and the server (started
by agl, :class:`~agl.tinker.server.SkyRLServer`) runs micro-batches of that size, so a step's shape is
one of a few sequence-length buckets (the server rounds lengths to two significant bits).

Checkpoints: ``save_checkpoint`` saves every adapter's weights and optimizer state on the service
(``save_state``) and writes the paths into ``output_dir/checkpoint-<step>/tinker_state.json`` beside
``trainer_state.json``; ``load_checkpoint`` loads them into fresh training clients
(``load_state_with_optimizer``). The state is also saved after every update, so a restarted server
goes on from the last step (:meth:`agl.tinker.service.TinkerService.recover`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agl.adapter.trajectories import merge_transitions, per_call_trajectories, token_advantages
from agl.algorithms.balance import balance_weights
from agl.errors import InfraError, UsageError
from agl.tinker.server import DATA_BUCKET
from agl.tinker.service import POLICY, TinkerService

if TYPE_CHECKING:
    from agl.config import RunConfig
    from agl.types import Transition

__all__ = ["DATA_BUCKET", "STATE_FILE", "TinkerPolicy", "check_settings", "datums"]

log = logging.getLogger("agl.tinker")

#: the file in a checkpoint folder naming each adapter's saved state on the service
STATE_FILE = "tinker_state.json"
#: the clip range the services' ``ppo`` uses when given none (Tinker's default, skyrl-tx's only one)
_DEFAULT_CLIP = 0.2
_ADAM = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}  # torch's AdamW defaults


def check_settings(config: RunConfig, *, sequence_mean: bool = False, off_policy: str = "drop") -> None:
    """Refuse what the service's losses cannot express (see the module docstring)."""
    if not config.lora:
        raise UsageError("backend='tinker' trains LoRA adapters on the service: lora=False cannot run there")
    if float(config.kl_coef) != 0.0:
        raise UsageError(
            "backend='tinker': the service's ppo loss has no KL term; use kl_coef=0 (or the local backends)"
        )
    if float(config.temperature) != 1.0:
        raise UsageError(
            f"backend='tinker': the service scores log-probs at temperature 1, so the run must sample at "
            f"temperature 1.0 (got {config.temperature!r}) for the ratio to be the acting policy's"
        )
    if off_policy == "tis":
        raise UsageError(
            "backend='tinker': off_policy='tis' (decoupled PPO) needs a proximal forward the service's "
            "losses do not take; use off_policy='drop'"
        )
    if int(config.lora_alpha) != 32:
        raise UsageError(
            f"backend='tinker': the services train LoRA with alpha 32; got lora_alpha={config.lora_alpha}"
        )
    low, high = _clip(config)
    if sequence_mean and (low != _DEFAULT_CLIP or high != _DEFAULT_CLIP):
        raise UsageError(
            f"backend='tinker' on skyrl-tx: its ppo loss clips the ratio at [0.8, 1.2] only; "
            f"clip_eps={low}, clip_eps_high={high} cannot run there"
        )


def _clip(config: RunConfig) -> tuple[float, float]:
    low = float(config.clip_eps)
    high = float(config.clip_eps_high) if config.clip_eps_high is not None else low
    return low, high


class TinkerPolicy:
    """LightningRL updates of LoRA adapters trained on a Tinker-API service (``service``); the
    trainer's policy interface (``step``, ``global_step``, ``save_checkpoint``, ``load_checkpoint``).
    ``adapters``: the Trainer's ``{agent: LoRA name}`` for an adapter per agent (None: one policy)."""

    is_lora = True
    precision = "no"

    def __init__(
        self,
        service: TinkerService,
        config: RunConfig,
        *,
        output_dir: str | os.PathLike[str],
        adapters: Mapping[str, str] | None = None,
        off_policy: str = "drop",
    ) -> None:
        self.service = service
        self.config = config
        self.output_dir = os.fspath(output_dir)
        #: ``{agent: adapter name}`` with an adapter per agent, else {}
        self.adapters: dict[str, str] = dict(adapters or {})
        service.connect()
        check_settings(config, sequence_mean=service.sequence_mean, off_policy=off_policy)
        local_only = {
            "share_prefixes": config.share_prefixes,
            "micro_batch_tokens": config.micro_batch_tokens is not None,
            "gradient_checkpointing": bool(config.gradient_checkpointing),
            "mixed_precision": config.mixed_precision not in (None, "no"),
        }
        used = [k for k, on in local_only.items() if on and k != "share_prefixes"]
        if used:
            log.info("agl tinker: %s: local-only settings, no effect on the service", ", ".join(used))
        self.global_step = 0
        self.kl_coef = 0.0

    # ------------------------------------------------------------------------------ step
    def step(
        self,
        transitions: Sequence[Transition],
        advantages: Sequence[float],
        *,
        merge_turns: bool | None = None,
        tis_cap: float | None = None,
    ) -> dict[str, float]:
        """One LightningRL update on the service: per adapter, ``epochs_per_step`` rounds of
        ``forward_backward`` and ``optim_step``; then the state is saved (the restore point of a
        restarted server). Metrics: the local update's names where they have a meaning here
        (``loss``, ``behaviour_ratio_dev`` from the service's own log-probs, token and sequence
        counts) and the seconds of each round trip (``forward_backward_s``, ``optim_step_s``,
        ``save_state_s``)."""
        if len(transitions) != len(advantages):
            raise ValueError(f"{len(transitions)} transitions but {len(advantages)} advantages")
        merge = self.config.merge_turns if merge_turns is None else merge_turns
        groups = self._groups(transitions, advantages)
        seen = self.service.restarts
        try:
            per = {name: self._step_adapter(name, ts, adv, merge) for name, (ts, adv) in groups.items()}
        except InfraError as exc:
            # a managed server that died mid-update: restarted on the last saved state, the step redone
            if not self.service.recover(seen):
                raise
            log.warning(
                "agl tinker: update %d redone after the server's restart (%s)", self.global_step + 1, exc
            )
            per = {name: self._step_adapter(name, ts, adv, merge) for name, (ts, adv) in groups.items()}
        self.global_step += 1
        t0 = time.perf_counter()
        self.service.save_state(self.global_step)
        out = _totals(per)
        out["save_state_s"] = time.perf_counter() - t0
        if self.adapters:
            out["unadapted"] = float(sum(1 for t in transitions if (t.agent or "") not in self.adapters))
            for name, m in per.items():
                for key in ("loss", "trained_transitions", "response_tokens", "behaviour_ratio_dev"):
                    if key in m:
                        out[f"{key}/{name}"] = m[key]
        return out

    def _groups(
        self, transitions: Sequence[Transition], advantages: Sequence[float]
    ) -> dict[str, tuple[list[Transition], list[float]]]:
        if not self.adapters:
            return {POLICY: (list(transitions), [float(a) for a in advantages])}
        groups: dict[str, tuple[list[Transition], list[float]]] = {
            n: ([], []) for n in self.adapters.values()
        }
        for t, a in zip(transitions, advantages, strict=True):
            name = self.adapters.get(t.agent or "")
            if name is not None:
                groups[name][0].append(t)
                groups[name][1].append(float(a))
        return groups

    def _step_adapter(
        self, name: str, transitions: list[Transition], advantages: list[float], merge: bool
    ) -> dict[str, float]:
        built = datums(
            transitions,
            advantages,
            self.config,
            merge=merge,
            sequence_mean=self.service.sequence_mean,
        )
        metrics: dict[str, float] = {
            "trained_transitions": float(built.trained_calls),
            "sequences": float(built.sequences),
            "skipped": float(len(transitions) - built.trained_calls),
            "response_tokens": float(built.trained_tokens),
            "update_tokens": float(built.tokens),
            "tinker_data": float(len(built.data)),
            "forward_backward_s": 0.0,
            "optim_step_s": 0.0,
        }
        if not built.data:  # nothing to train: the adapter is left as it was
            metrics["loss"] = 0.0
            return metrics
        low, high = _clip(self.config)
        loss_config = None
        if (low, high) != (_DEFAULT_CLIP, _DEFAULT_CLIP):
            loss_config = {"clip_low_threshold": 1.0 - low, "clip_high_threshold": 1.0 + high}
        adam = {**_ADAM, "learning_rate": float(self.config.learning_rate)}
        adam["grad_clip_norm"] = float(self.config.max_grad_norm or 0.0)
        losses: list[float] = []
        for epoch in range(max(1, int(self.config.epochs_per_step))):
            t0 = time.perf_counter()
            out = self.service.forward_backward(name, built.data, "ppo", loss_config)
            metrics["forward_backward_s"] += time.perf_counter() - t0
            losses.append(_loss(out, built))
            if epoch == 0:
                dev = _ratio_dev(out, built)
                if dev is not None:
                    metrics["behaviour_ratio_dev"] = dev
            t0 = time.perf_counter()
            self.service.optim_step(name, adam)
            metrics["optim_step_s"] += time.perf_counter() - t0
        metrics["loss"] = float(sum(losses) / len(losses))
        metrics["learning_rate"] = float(self.config.learning_rate)
        return metrics

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        """``output_dir/checkpoint-<step>``: the service's saved state of every adapter (the one the
        last step saved, else saved now) and ``trainer_state.json``; returns the folder."""
        path = os.path.join(self.output_dir, f"checkpoint-{self.global_step}")
        os.makedirs(path, exist_ok=True)
        paths = self.service.states.get(self.global_step) or self.service.save_state(self.global_step)
        body = {
            "url": self.service.url,
            "base_model": self.service.base_model,
            "lora_rank": self.service.lora_rank,
            "adapters": paths,
        }
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump(body, f, indent=2)
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"global_step": self.global_step}, f)
        return path

    def load_checkpoint(self, path: str | os.PathLike[str]) -> int:
        """Load a checkpoint folder written by :meth:`save_checkpoint`; returns its step."""
        path = os.fspath(path)
        state_file = os.path.join(path, STATE_FILE)
        if not os.path.isfile(state_file):
            raise FileNotFoundError(f"{path} is not an agl Tinker checkpoint (no {STATE_FILE})")
        with open(state_file) as f:
            body = json.load(f)
        self.service.load_state(body["adapters"])
        with open(os.path.join(path, "trainer_state.json")) as f:
            self.global_step = int(json.load(f)["global_step"])
        self.service.states[self.global_step] = dict(body["adapters"])
        self.service.last_good_step = self.global_step
        return self.global_step

    def save_adapter(self, path: str | os.PathLike[str]) -> str:
        raise UsageError(
            "backend='tinker': the adapter lives on the service; its saved state paths are in the "
            f"checkpoint's {STATE_FILE} (the service's own download, where it offers one, fetches it)"
        )

    def end(self, summary: Any = None) -> None:  # the distributed leader's hook; one process here
        return None


class _Built:
    """The data of one adapter's update and what they hold."""

    def __init__(self) -> None:
        self.data: list[Any] = []
        self.real = 0  # data before the padding ones
        self.sequences = 0
        self.trained_calls = 0
        self.trained_tokens = 0
        self.tokens = 0
        #: per real datum: (the target positions trained, their behaviour log-probs)
        self.scored: list[tuple[list[int], list[float]]] = []
        self.scale: list[float] = []


def datums(
    transitions: Sequence[Transition],
    advantages: Sequence[float],
    config: RunConfig,
    *,
    merge: bool = True,
    sequence_mean: bool = False,
    bucket: int = DATA_BUCKET,
) -> _Built:
    """The service's data for one adapter's update (see the module docstring)."""
    import tinker

    built = _Built()
    rows = _rows(transitions, advantages, config, merge, built)
    n_tok = sum(sum(m) for _, m, _ in rows)
    if not rows:
        return built
    n_data = len(rows)
    if sequence_mean:
        n_data = math.ceil(n_data / bucket) * bucket
    for seq, mask, adv in rows:
        tokens = [*seq.prompt_ids, *seq.completion_ids]
        p = len(seq.prompt_ids)
        n = len(tokens) - 1
        weights, advs, lps = [0.0] * n, [0.0] * n, [0.0] * n
        m_i = sum(mask)
        scale = (n_data * m_i / n_tok) if sequence_mean else 1.0 / n_tok
        behaviour = seq.logprobs
        positions = []
        for c, on in enumerate(mask):
            j = p + c - 1  # the target position of completion token c
            if behaviour is not None:
                lps[j] = float(behaviour[c])
            if on:
                weights[j] = 1.0
                advs[j] = adv[c] * scale
                positions.append(j)
        inputs: dict[str, Any] = {"target_tokens": tokens[1:], "logprobs": lps, "advantages": advs}
        if sequence_mean:
            inputs["weights"] = weights
        built.data.append(
            tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
        )
        built.scored.append((positions, [lps[j] for j in positions]))
        built.scale.append(scale)
        built.tokens += len(tokens)
    built.real = len(built.data)
    built.sequences = len(rows)
    built.trained_tokens = n_tok
    _pad(built, n_data)
    if any(seq.logprobs is None for seq, _, _ in rows):
        log.warning(
            "agl tinker: some sequences carry no behaviour log-probs; their ratio is taken against 0 "
            "(record them: the tinker backend returns them on every call)"
        )
    return built


def _rows(
    transitions: Sequence[Transition],
    advantages: Sequence[float],
    config: RunConfig,
    merge: bool,
    built: _Built,
) -> list[tuple[Any, list[int], list[float]]]:
    """``(sequence, loss mask, token advantages)`` of each sequence with a trained token: the calls
    that train (a reply, not masked as truncated, a non-zero advantage) keep their mask, weighted by
    the loss balance; ``built.trained_calls`` counts them."""
    seqs, _ = (merge_transitions if merge else per_call_trajectories)(transitions)
    trained = {
        i
        for i, t in enumerate(transitions)
        if t.response_ids and not (config.mask_truncated and t.truncated) and float(advantages[i]) != 0.0
    }
    factors = balance_weights(transitions, trained, config.loss_balance)
    weighted = [float(a) * w for a, w in zip(advantages, factors, strict=True)]
    rows = []
    for seq in seqs:
        mask = list(seq.loss_mask)
        for seg in seq.segments:
            if seg.transition not in trained:
                mask[seg.start : seg.end] = [0] * (seg.end - seg.start)
        if not any(mask):
            continue
        built.trained_calls += sum(1 for seg in seq.segments if seg.transition in trained)
        rows.append((seq, mask, token_advantages(seq, weighted)))
    return rows


def _pad(built: _Built, n_data: int) -> None:
    """Zero-weight data up to ``n_data``: the same shape as the first datum, no gradient (the service
    then compiles one program per bucket of data, not one per batch)."""
    import tinker

    while len(built.data) < n_data:
        first = built.data[0]
        zeros = [0.0] * len(first.loss_fn_inputs["advantages"].data)
        built.data.append(
            tinker.Datum(
                model_input=first.model_input,
                loss_fn_inputs={
                    "target_tokens": first.loss_fn_inputs["target_tokens"],
                    "logprobs": zeros,
                    "advantages": zeros,
                    "weights": zeros,
                },
            )
        )


def _outputs(out: Any) -> list[dict[str, Any]]:
    return list(getattr(out, "loss_fn_outputs", None) or [])


def _values(value: Any) -> list[float]:
    data = getattr(value, "data", value)
    return [float(x) for x in (data.tolist() if hasattr(data, "tolist") else data)]


def _loss(out: Any, built: _Built) -> float:
    """The step's token-mean PPO loss, from the service's per-token losses (each datum's scale undone)."""
    total = 0.0
    for k, o in enumerate(_outputs(out)[: built.real]):
        if "elementwise_loss" not in o:
            continue
        per = _values(o["elementwise_loss"])
        positions, _ = built.scored[k]
        scale = built.scale[k] or 1.0
        total += sum(per[j] for j in positions if j < len(per)) / scale
    return total / max(built.trained_tokens, 1)


def _ratio_dev(out: Any, built: _Built) -> float | None:
    """max |exp(service log-prob - behaviour log-prob) - 1| over the trained tokens before the first
    optimizer step: ~0 when the service's training forward scores what its sampler sampled."""
    devs = []
    for k, o in enumerate(_outputs(out)[: built.real]):
        if "logprobs" not in o:
            continue
        lp = _values(o["logprobs"])
        positions, behaviour = built.scored[k]
        devs += [
            abs(math.exp(lp[j] - b) - 1.0) for j, b in zip(positions, behaviour, strict=True) if j < len(lp)
        ]
    return max(devs) if devs else None


def _totals(per: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    sums = ("trained_transitions", "sequences", "skipped", "response_tokens", "update_tokens", "tinker_data")
    out = {k: float(sum(m.get(k, 0.0) for m in per.values())) for k in sums}
    out["forward_backward_s"] = float(sum(m.get("forward_backward_s", 0.0) for m in per.values()))
    out["optim_step_s"] = float(sum(m.get("optim_step_s", 0.0) for m in per.values()))
    out["update_s"] = out["forward_backward_s"] + out["optim_step_s"]
    trained = [m for m in per.values() if m.get("tinker_data", 0.0) > 0]
    out["loss"] = float(sum(m["loss"] for m in trained) / len(trained)) if trained else 0.0
    devs = [m["behaviour_ratio_dev"] for m in trained if "behaviour_ratio_dev" in m]
    if devs:
        out["behaviour_ratio_dev"] = max(devs)
    rates = [m["learning_rate"] for m in trained if "learning_rate" in m]
    if rates:
        out["learning_rate"] = rates[-1]
    return out
