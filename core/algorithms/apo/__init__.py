"""APO — automatic prompt optimisation: rewrite an agent's prompts from critiques of its failures.

``agl.Trainer(algorithm=agl.APO(...)).fit(agent, train, val)`` (or ``agl apo``) improves the prompt
templates an agent reads with :func:`agl.prompt`, using any OpenAI-compatible LLM as the optimiser:
no GPU, no gradient, the same store, runners, gateway and traces as LightningRL.

Each round (docs/architecture.md §9, "APO"):

1. every candidate of the beam runs ``rollouts_per_candidate`` training tasks (one resources version
   per candidate: its prompts plus the agent's LLM, so each rollout records the version it used);
2. its failures (reward below ``failure_below``, or errors) are read back from the store and their
   spans turned into readable traces (:func:`summarize_trace`);
3. the optimiser LLM writes a critique of the prompt from those traces (the *textual gradient*), then
   a rewrite that answers it (the *edit*), ``branch_factor`` children per beam candidate;
4. each child runs every validation task; 5. the ``beam_width`` best by validation reward stay.

Where things are:

- :mod:`~agl.algorithms.apo.algorithm`: ``APO`` — the knobs, their validation, ``fit``/``optimize``;
- :mod:`~agl.algorithms.apo.settings`: ``RunSettings`` — what a run borrows from the Trainer;
- :mod:`~agl.algorithms.apo.loop`: ``ApoRun`` — the rounds above;
- :mod:`~agl.algorithms.apo.beam`: ``Candidate``, beam selection, which failures are critiqued;
- :mod:`~agl.algorithms.apo.evaluation`: running candidates' rollouts and reading their rewards;
- :mod:`~agl.algorithms.apo.optimizer`: the optimiser client — critique, rewrite, budget, failures;
- :mod:`~agl.algorithms.apo.text`: the optimiser's instructions, reply parsing, trace summaries;
- :mod:`~agl.algorithms.apo.environment`: the stores, gateways and runners a run starts;
- :mod:`~agl.algorithms.apo.artifacts`: the run directory's files;
- ``agl apo`` is :mod:`agl.cli.apo`.

The optimiser's calls go through an agl gateway of their own, each as a rollout in the optimiser
store (``run_dir/optimizer.db`` by default), so ``agl spans`` shows every critique and rewrite with
its prompt. Budgets: ``rounds``, ``beam_width``, ``branch_factor``, ``rollouts_per_candidate`` and
``max_optimizer_tokens`` (a call is made only when its estimated size fits what is left).
Optimiser failures — an HTTP error, a reply that is not the asked-for JSON (one repair request is
sent), an empty rewrite, a rewrite that drops or adds ``{placeholders}`` — cost that child only;
the round goes on and the failure is counted in the metrics.

``run_dir`` receives ``metrics.jsonl`` (one record per round, ``agl plot`` draws it),
``candidates.jsonl`` (every candidate with its prompts, versions, scores, parent and critique),
``prompts/round-N.json`` (the best prompts after round N), ``best_prompts.json`` and
``reward_curve.png``.
"""

from __future__ import annotations

from agl.algorithms.apo.algorithm import APO
from agl.algorithms.apo.beam import Candidate
from agl.algorithms.apo.settings import RunSettings
from agl.algorithms.apo.text import (
    CRITIQUE_SYSTEM,
    REWRITE_SYSTEM,
    OptimizerError,
    parse_rewrite,
    summarize_trace,
)

__all__ = [
    "APO",
    "Candidate",
    "CRITIQUE_SYSTEM",
    "OptimizerError",
    "REWRITE_SYSTEM",
    "RunSettings",
    "parse_rewrite",
    "summarize_trace",
]
