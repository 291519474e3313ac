"""LightningRL credit assignment and advantages, checked against values computed by hand.

The running example (docs/architecture.md §8): one group "g" of three rollouts,

    rollout  R_i   intermediate r_ij
    a        1.0   [0.0, -0.1]     (the 2nd call issued a failing tool call)
    b        0.0   [0.0]
    c        0.5   [0.2, 0.0]
"""

from __future__ import annotations

import math
import random

import pytest

from agl.algorithms import LightningRL, assign_credit, compute_advantages, credit_returns, group_statistics
from agl.types import Transition

EPS = 1e-6


def tr(
    rollout: str, index: int, final: float, inter: float = 0.0, group: str | None = "g", **kw
) -> Transition:
    return Transition(
        rollout_id=rollout,
        attempt=kw.pop("attempt", 1),
        group_id=group,
        index=index,
        prompt_ids=(1,),
        response_ids=(2,),
        final_reward=final,
        intermediate_reward=inter,
        **kw,
    )


def example() -> list[Transition]:
    return [
        tr("a", 0, 1.0, 0.0),
        tr("a", 1, 1.0, -0.1),
        tr("b", 0, 0.0, 0.0),
        tr("c", 0, 0.5, 0.2),
        tr("c", 1, 0.5, 0.0),
    ]


# ------------------------------------------------------------------------------------ config


def test_fields_are_exactly_the_contract() -> None:
    cfg = LightningRL()
    assert cfg.to_dict() == {
        "credit": "identical",
        "gamma": 1.0,
        "advantage_level": "rollout",
        "normalize_std": True,
        "group_size": 4,
        "agent_baseline": "auto",
        "min_group_fraction": 0.75,
        "running_window": 4,
        "clip_eps": 0.2,
        "clip_eps_high": None,
        "kl_coef": 0.0,
        "learning_rate": 1e-5,
        "lora": True,
        "lora_r": 16,
        "lora_alpha": 32,
        "micro_batch_tokens": None,
        "epochs_per_step": 1,
        "max_grad_norm": 1.0,
        "gradient_checkpointing": None,
        "mixed_precision": None,
        "merge_turns": True,
        "share_prefixes": True,
        "mask_truncated": False,
        "loss_balance": "token",
    }


@pytest.mark.parametrize(
    "kw",
    [
        {"credit": "sum"},
        {"advantage_level": "token"},
        {"gamma": 1.5},
        {"gamma": float("nan")},
        {"group_size": 0},
        {"clip_eps": 0},
        {"clip_eps_high": -1.0},
        {"kl_coef": -0.1},
        {"learning_rate": 0},
        {"micro_batch_tokens": 1.5},
        {"normalize_std": "yes"},
    ],
)
def test_bad_config_is_refused_with_the_field_named(kw) -> None:
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        LightningRL(**kw)


# ------------------------------------------------------------------------------------ credit


def test_identical_credit_by_hand() -> None:
    assert credit_returns(1.0, [0.0, -0.1]) == pytest.approx([1.0, 0.9])
    assert credit_returns(1.0, [0.0, -0.1], include_intermediate=False) == [1.0, 1.0]
    assert credit_returns(0.5, []) == []


def test_discounted_credit_by_hand() -> None:
    cfg = LightningRL(credit="discounted", gamma=0.5)
    # G_2 = -0.1 + 0.5 * 1.0 = 0.4 ; G_1 = 0.0 + 0.5 * 0.4 = 0.2
    assert credit_returns(1.0, [0.0, -0.1], cfg) == pytest.approx([0.2, 0.4])
    # G_2 = 0 + 0.5*0.5 = 0.25 ; G_1 = 0.2 + 0.5*0.25 = 0.325
    assert credit_returns(0.5, [0.2, 0.0], cfg) == pytest.approx([0.325, 0.25])
    # gamma = 1 sums the future intermediate rewards onto R
    one = LightningRL(credit="discounted", gamma=1.0)
    assert credit_returns(1.0, [0.3, -0.1, 0.0], one) == pytest.approx([1.2, 0.9, 1.0])
    # gamma = 1 and no intermediate rewards is identical credit
    assert credit_returns(0.7, [0.0, 0.0, 0.0], one) == credit_returns(0.7, [0.0, 0.0, 0.0]) == [0.7] * 3


def test_assign_credit_keeps_order_and_sets_reward_only() -> None:
    ts = example()
    shuffled = ts[::-1]
    out = assign_credit(shuffled, LightningRL(credit="discounted", gamma=0.5))
    assert [t.span_id for t in out] == [t.span_id for t in shuffled]
    by = {(t.rollout_id, t.index): t.reward for t in out}
    assert by == pytest.approx({("a", 0): 0.2, ("a", 1): 0.4, ("b", 0): 0.0, ("c", 0): 0.325, ("c", 1): 0.25})
    assert [t.model_copy(update={"reward": 0.0}) for t in out] == shuffled
    assert [t.reward for t in LightningRL().assign_credit(ts)] == pytest.approx([1.0, 0.9, 0.0, 0.7, 0.5])


def test_inconsistent_input_is_refused() -> None:
    with pytest.raises(ValueError, match="index 0"):
        compute_advantages([tr("a", 0, 1.0), tr("a", 0, 1.0)])
    with pytest.raises(ValueError, match="final rewards"):
        compute_advantages([tr("a", 0, 1.0), tr("a", 1, 0.0)])
    with pytest.raises(ValueError, match="different groups"):
        compute_advantages([tr("a", 0, 1.0, group="x"), tr("a", 1, 1.0, group="y")])


# ------------------------------------------------------------------------------------ advantages


def test_rollout_level_advantages_by_hand() -> None:
    # finals 1, 0, 0.5: mean 0.5, sample std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
    # identical returns: a [1.0, 0.9]; b [0.0]; c [0.7, 0.5]; A = (G - 0.5) / (0.5 + eps)
    adv, stats = compute_advantages(example(), LightningRL())
    s = 0.5 + EPS
    assert adv == pytest.approx([0.5 / s, 0.4 / s, -0.5 / s, 0.2 / s, 0.0], abs=1e-12)
    assert stats["groups"] == 1 and stats["zero_variance_groups"] == 0 and stats["rollouts"] == 3
    assert stats["transitions"] == 5 and stats["incomplete_groups"] == 1  # 3 rollouts, group_size 4
    assert stats["final_reward_mean"] == pytest.approx(0.5)
    # without std normalisation: A = G - 0.5
    adv, _ = compute_advantages(example(), LightningRL(normalize_std=False))
    assert adv == pytest.approx([0.5, 0.4, -0.5, 0.2, 0.0])
    # the paper's identical credit (no intermediate rewards): every transition gets (R - 0.5) / 0.5
    adv, _ = compute_advantages(example(), LightningRL(), include_intermediate=False)
    assert adv == pytest.approx([0.5 / s, 0.5 / s, -0.5 / s, 0.0, 0.0])


def test_transition_level_advantages_by_hand() -> None:
    # returns 1.0, 0.9, 0.0, 0.7, 0.5: mean 0.62; squared deviations sum 0.628; sample std sqrt(0.157)
    adv, stats = compute_advantages(example(), LightningRL(advantage_level="transition"))
    std = math.sqrt(0.157)
    expected = [(g - 0.62) / (std + EPS) for g in (1.0, 0.9, 0.0, 0.7, 0.5)]
    assert adv == pytest.approx(expected)
    assert stats["zero_variance_groups"] == 0
    adv, _ = compute_advantages(example(), LightningRL(advantage_level="transition", normalize_std=False))
    assert adv == pytest.approx([0.38, 0.28, -0.62, 0.08, -0.12])


def test_discounted_rollout_level_by_hand() -> None:
    cfg = LightningRL(credit="discounted", gamma=0.5, normalize_std=False)
    adv, _ = compute_advantages(example(), cfg)
    # returns a [0.2, 0.4], b [0.0], c [0.325, 0.25]; baseline mean of finals 0.5
    assert adv == pytest.approx([-0.3, -0.1, -0.5, -0.175, -0.25])


def test_zero_variance_groups_get_zero_advantage_and_are_counted() -> None:
    ts = [
        tr("s1", 0, 1.0, group="same"),
        tr("s2", 0, 1.0, -0.1, group="same"),  # same final reward; an AIR penalty
        tr("s3", 0, 1.0, group="alone"),  # a group of one rollout
        tr("s4", 0, 1.0, group=None),  # no group: compared with nothing
        *example(),
    ]
    adv, stats = compute_advantages(ts, LightningRL())
    assert adv[:4] == [0.0, 0.0, 0.0, 0.0]
    assert any(a != 0.0 for a in adv[4:])
    assert stats["groups"] == 4 and stats["zero_variance_groups"] == 3
    assert stats["zero_variance_fraction"] == pytest.approx(0.75)
    # at transition level the AIR penalty is the only signal in "same": mean 0.95, std sqrt(0.005)
    adv, stats = compute_advantages(ts, LightningRL(advantage_level="transition"))
    s = math.sqrt(0.005) + EPS
    assert adv[:2] == pytest.approx([0.05 / s, -0.05 / s])
    assert adv[2:4] == [0.0, 0.0] and stats["zero_variance_groups"] == 2


def test_float_noise_counts_as_zero_variance() -> None:
    ts = [tr("a", 0, 0.1 + 0.2), tr("b", 0, 0.3)]
    adv, stats = compute_advantages(ts)
    assert adv == [0.0, 0.0] and stats["zero_variance_groups"] == 1


def test_advantages_recomputed_from_rewards_not_from_reward_field() -> None:
    ts = [t.model_copy(update={"reward": 123.0}) for t in example()]
    assert compute_advantages(ts)[0] == compute_advantages(example())[0]


def test_attempts_of_one_rollout_are_separate_and_order_is_preserved() -> None:
    ts = example() + [tr("a", 0, 0.0, attempt=2)]
    random.Random(0).shuffle(ts)
    adv, stats = compute_advantages(ts, LightningRL(normalize_std=False))
    assert stats["rollouts"] == 4
    mean = (1.0 + 0.0 + 0.5 + 0.0) / 4
    for t, a in zip(ts, adv, strict=True):
        g = {("a", 0, 1): 1.0, ("a", 1, 1): 0.9, ("b", 0, 1): 0.0, ("c", 0, 1): 0.7, ("c", 1, 1): 0.5}.get(
            (t.rollout_id, t.index, t.attempt), 0.0
        )
        assert a == pytest.approx(g - mean)


def test_group_statistics() -> None:
    gs = group_statistics(example())["g"]
    assert (gs.rollouts, gs.transitions) == (3, 5)
    assert gs.mean == pytest.approx(0.5) and gs.std == pytest.approx(0.5) and not gs.zero_variance
    gt = group_statistics(example(), LightningRL(advantage_level="transition"))["g"]
    assert gt.mean == pytest.approx(0.62) and gt.std == pytest.approx(math.sqrt(0.157))


def test_empty_input() -> None:
    adv, stats = compute_advantages([])
    assert adv == [] and stats["groups"] == 0 and stats["transitions"] == 0


def test_the_method_uses_the_returns_the_adapter_credited() -> None:
    """Credit once: LightningRL.compute_advantages normalises Transition.reward (the adapter's credited
    return) instead of crediting again; on credited transitions the numbers equal a recomputation."""
    for cfg in (LightningRL(), LightningRL(credit="discounted", gamma=0.5, advantage_level="transition")):
        credited = cfg.assign_credit(example())
        assert cfg.compute_advantages(credited) == compute_advantages(credited, cfg)
        stale = [t.model_copy(update={"reward": 0.0}) for t in credited]  # rewards no one credited
        if cfg.advantage_level == "transition":
            assert cfg.compute_advantages(stale)[0] != compute_advantages(stale, cfg)[0]
        assert cfg.compute_advantages(stale, include_intermediate=True) == compute_advantages(stale, cfg)
