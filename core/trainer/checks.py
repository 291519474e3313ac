"""``StepChecks``: what the training loop checks after each step, so a run that cannot learn says so.

- a step whose agent selection matched none of its LLM calls is refused (the update would train on
  nothing), and calls outside any agent span are warned about once;
- after the first step with LLM calls, an agent selected by name that made none of them is refused when
  named agents that are not selected did (most likely a typo: the error names the agents seen), and
  warned about once otherwise (an agent called only on some tasks, like a rewriter that runs when a
  query fails);
- an update whose first PPO ratio is far from 1 (the recorded behaviour policy is not the policy the
  update scores) is warned about once; under mixed precision, where the update corrects for it by
  decoupled PPO, it is logged once at INFO with its size.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from agl.config import RunConfig
from agl.errors import UsageError

__all__ = ["StepChecks"]

log = logging.getLogger("agl.trainer")


class StepChecks:
    """The loop's per-step sanity checks; each warning is given once per run."""

    def __init__(self) -> None:
        self.warned_unattributed = False
        self.warned_off_policy = False
        self.checked_names = False

    def adapted(self, step: int, stats: Any, agents: Any) -> None:
        """Refuse a step whose agent selection matched none of its LLM calls (the update would
        silently train on nothing), and warn once when calls lost their agent spans."""
        if stats.unattributed_calls and not self.warned_unattributed:
            self.warned_unattributed = True
            log.warning(
                "agl trainer: step %d: %d LLM calls ran outside every agent span in attempts whose own spans "
                "show an agent framework at work. The framework's hooks were bypassed or removed — e.g. "
                "an Agents SDK app calling set_trace_processors() after agl.instrument(), or an agent run "
                "outside the rollout's context — so agents= cannot select these calls",
                step,
                stats.unattributed_calls,
            )
        if stats.llm_calls and stats.unselected == stats.llm_calls and stats.transitions == 0:
            seen = ", ".join(f"{name or '<no agent span>'} ({n})" for name, n in sorted(stats.agents.items()))
            raise RuntimeError(
                f"step {step}: the agent selection agents={agents!r} matched 0 of "
                f"{stats.llm_calls} LLM calls, so there is nothing to train on. Agents seen: {seen}. "
                "Check the names given as agents= (they match invoke_agent span names) and that the "
                "agent framework is instrumented (agl.instrument()) before the agent is built"
            )
        if stats.llm_calls and not self.checked_names:
            self.checked_names = True
            self._named_agents_seen(step, stats, agents)

    def _named_agents_seen(self, step: int, stats: Any, agents: Any) -> None:
        """The first step with LLM calls: every agent selected by name made some, or a clear error (see
        the module docstring). A regular expression selects no particular name: nothing to check."""
        if agents is None or isinstance(agents, (str, re.Pattern)):
            return
        made = {name for name, n in stats.agents.items() if n}
        wanted = {a.strip() if isinstance(a, str) else a for a in agents}  # as people see them (agl.names)
        missing = [a for a in agents if (a.strip() if isinstance(a, str) else a) not in made]
        if not missing:
            return
        seen = ", ".join(f"{name or '<no agent span>'} ({n})" for name, n in sorted(stats.agents.items()))
        others = sorted(name for name in made if name and name not in wanted)
        if others:  # calls of named agents that are not selected: most likely a misspelt selection
            raise UsageError(
                f"step {step}: the selected agent(s) {', '.join(map(repr, missing))} made none of the "
                f"{stats.llm_calls} LLM calls, while agents that are not selected ({', '.join(others)}) "
                f"made some. Agents seen: {seen}. Check the names given as agents= (they match "
                "invoke_agent span names)"
            )
        log.warning(
            "agl trainer: step %d: the selected agent(s) %s made no LLM call (agents seen: %s); fine for an "
            "agent called only on some tasks, else check the names given as agents=",
            step,
            ", ".join(map(repr, missing)),
            seen,
        )

    #: a first-micro-batch ratio further than this from 1 means the recorded behaviour policy is not
    #: the policy the update scores. Both sides without autocast (the CPU) stay under 1e-4; a
    #: bf16-autocast update against the engine's log-probs does not: max |ratio - 1| read 0.4-2.9 per
    #: step on an H100 (calc_agent, bench/README.md)
    OFF_POLICY_WARN = 0.05

    def on_policy(
        self,
        ratio_dev: float | None,
        config: RunConfig,
        precision: str = "no",
        corrected: bool = False,
        *,
        engine: str | None = None,
    ) -> None:
        """Say once when the update's first ratio shows that the engine's recorded log-probs are not the
        policy's. A separate ``engine`` (vLLM) with ``corrected`` is expected and logged at INFO. Under mixed precision with ``corrected`` (the update trains by decoupled PPO, so the
        mismatch is weighted, not clipped) that is expected and logged at INFO with its size; otherwise
        a warning names the likeliest cause: the update's autocast when it has one, else sampling
        settings the agent overrides or weights the engine does not share."""
        if ratio_dev is None or ratio_dev <= self.OFF_POLICY_WARN or self.warned_off_policy:
            return
        self.warned_off_policy = True
        if engine is not None and corrected:  # a separate engine (vLLM): its own kernels and dtype
            log.info(
                "agl trainer: the %s engine computes its log-probs apart from the update (its own kernels, "
                "often bf16), so they differ from the update's (max |ratio - 1| %.3g in the first update); "
                "every step trains by decoupled PPO against the update's own log-probs, each token weighted "
                "by min(pi/mu, tis_cap): tis_weight_mean and tis_clip_fraction in the metrics show how much",
                engine,
                ratio_dev,
            )
            return
        if precision != "no" and corrected:
            log.info(
                "agl trainer: the update runs in %s autocast and the engine without it, so their log-probs "
                "of the same tokens differ (max |ratio - 1| %.3g in the first update); every step trains by "
                "decoupled PPO against the update's own log-probs, each token weighted by min(pi/mu, "
                "tis_cap): tis_weight_mean and tis_clip_fraction in the metrics show how much that weighs",
                precision,
                ratio_dev,
            )
            return
        if precision != "no":
            cause = (
                f"The update runs in {precision} autocast while the engine, serving the same weights, "
                "computes its log-probs without it: LightningRL(mixed_precision='no') makes the two agree "
                "(cheap for a small model); otherwise PPO's clip absorbs the mismatch, untested for learning"
            )
        else:
            cause = (
                f"Most likely the agent sends its own temperature/top_p instead of resources.llm.sampling "
                f"({config.sampling}), or the engine serves other weights than the policy's"
            )
        log.warning(
            "agl trainer: before its first optimizer step the update's PPO ratio is off by %.3g: the "
            "log-probs the engine recorded are not the policy's at temperature %g. %s",
            ratio_dev,
            config.temperature,
            cause,
        )
