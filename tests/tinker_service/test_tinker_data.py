"""The data a step sends the service (``agl.algorithms.tinker_update.datums``): exact ids, the loss
mask in the advantages, and a scale that makes either service's reduction agl's token mean. Needs the
tinker SDK (its ``Datum`` type), not a server."""

from __future__ import annotations

import pytest

from agl.config import RunConfig
from agl.types import Transition

tinker = pytest.importorskip("tinker")


def _t(index: int, prompt: list[int], response: list[int], rollout: str = "r1") -> Transition:
    return Transition(
        rollout_id=rollout,
        attempt=1,
        index=index,
        agent="a",
        prompt_ids=tuple(prompt),
        response_ids=tuple(response),
        response_logprobs=tuple(-0.5 for _ in response),
    )


def _sum_reduction(built) -> float:  # Tinker: per-token losses summed
    return sum(sum(d.loss_fn_inputs["advantages"].data) for d in built.data)


def _mean_reduction(built) -> float:  # skyrl-tx: each datum averaged over its weights, then over the data
    per = []
    for d in built.data:
        w = d.loss_fn_inputs["weights"].data
        adv = d.loss_fn_inputs["advantages"].data
        per.append(sum(a * x for a, x in zip(adv, w, strict=True)) / max(sum(w), 1e-9))
    return sum(per) / len(per)


def test_one_datum_per_sequence_with_exact_ids_and_the_mask_in_the_advantages() -> None:
    from agl.algorithms.tinker_update import datums

    first = _t(0, [1, 2, 3], [4, 5])
    second = _t(1, [1, 2, 3, 4, 5, 9], [6, 7, 8])  # extends the first call exactly: one sequence
    built = datums([first, second], [1.0, -0.5], RunConfig(), merge=True)
    assert built.real == len(built.data) == 1 and built.sequences == 1
    d = built.data[0]
    tokens = [1, 2, 3, 4, 5, 9, 6, 7, 8]
    assert d.model_input.to_ints() == tokens[:-1]
    assert d.loss_fn_inputs["target_tokens"].data == tokens[1:]
    adv = d.loss_fn_inputs["advantages"].data
    n = 5  # trained tokens: 2 + 3
    assert adv == pytest.approx([0, 0, 1 / n, 1 / n, 0, -0.5 / n, -0.5 / n, -0.5 / n])  # 9 is context
    lps = d.loss_fn_inputs["logprobs"].data
    assert lps == pytest.approx([0, 0, -0.5, -0.5, 0, -0.5, -0.5, -0.5])
    assert "weights" not in d.loss_fn_inputs  # Tinker: the mask is in the advantages


@pytest.mark.parametrize("balance", ["token", "transition", "rollout"])
def test_either_reduction_gives_the_token_mean(balance: str) -> None:
    """The same transitions: Tinker's sum and skyrl-tx's per-datum mean (padded with zero-weight data
    to a multiple of 4) both weigh each trained token as agl's token mean does."""
    from agl.algorithms.balance import balance_weights
    from agl.algorithms.tinker_update import datums

    ts = [_t(0, [1, 2], [3, 4, 5], "r1"), _t(0, [1, 7], [8], "r2"), _t(0, [1, 9, 9], [2, 2, 2, 2, 2], "r3")]
    adv = [1.0, -2.0, 0.5]
    config = RunConfig(loss_balance=balance)
    factors = balance_weights(ts, {0, 1, 2}, balance)
    n = sum(len(t.response_ids) for t in ts)
    want = sum(a * f * len(t.response_ids) for a, f, t in zip(adv, factors, ts, strict=True)) / n
    hosted = datums(ts, adv, config, merge=False)
    skyrl = datums(ts, adv, config, merge=False, sequence_mean=True)
    assert len(hosted.data) == 3 and len(skyrl.data) == 4 and skyrl.real == 3
    assert sum(skyrl.data[3].loss_fn_inputs["weights"].data) == 0  # the padding datum trains nothing
    assert _sum_reduction(hosted) == pytest.approx(want)
    assert _mean_reduction(skyrl) == pytest.approx(want)


def test_calls_left_out_train_nothing() -> None:
    from agl.algorithms.tinker_update import datums

    ts = [_t(0, [1, 2], [3, 4], "r1"), _t(0, [1, 5], [6], "r2")]
    assert datums(ts, [0.0, 0.0], RunConfig()).data == []  # zero advantages: no datum at all
    built = datums(ts, [0.0, 1.0], RunConfig())
    assert built.trained_calls == 1 and built.trained_tokens == 1
