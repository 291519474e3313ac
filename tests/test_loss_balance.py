"""``loss_balance`` (issue 64): with ``"rollout"`` a rollout of 1 call and one of 5 weigh the same in the
loss, read off the real update's per-token weights (its plan's token advantages), with and without
merged multi-turn sequences and with calls split between agents; ``"token"`` stays today's token mean.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from agl.algorithms.balance import balance_weights  # noqa: E402
from agl.chat.tokenizer import load_tokenizer  # noqa: E402
from agl.types import Transition  # noqa: E402


def _rollouts(agents: tuple[str | None, str | None] = (None, None)) -> list[Transition]:
    """Rollout "one": 1 call of 3 tokens. Rollout "five": 5 calls of 2 tokens, each re-sending the
    conversation so far exactly (they merge into one sequence per agent), alternating ``agents``."""
    ts = [
        Transition(
            rollout_id="one", attempt=1, group_id="g", index=0, prompt_ids=(1, 2), response_ids=(7, 8, 9)
        )
    ]
    prompt: tuple[int, ...] = (1, 2)
    for i in range(5):
        agent = agents[i % 2]
        response = (100 + 2 * i, 101 + 2 * i)
        ts.append(
            Transition(
                rollout_id="five",
                attempt=1,
                group_id="g",
                agent=agent,
                index=i,
                prompt_ids=prompt,
                response_ids=response,
            )
        )
        if agents[0] == agents[1]:
            prompt = prompt + response + (50 + i,)  # the next turn continues this one exactly
    return ts


def _weights_per_rollout(tmp_path: Path, balance: str, ts: list[Transition], merge: bool) -> dict[str, float]:
    from tests.test_update import make

    pu = make(load_tokenizer(), tmp_path, loss_balance=balance)
    plan = pu._plan(ts, [1.0] * len(ts), merge)  # advantage 1: a token's advantage is its loss weight
    out: dict[str, float] = {}
    for k in plan.keep:
        seq, mask, adv = plan.seqs[k], plan.train_masks[k], plan.token_adv[k]
        out[seq.rollout_id] = out.get(seq.rollout_id, 0.0) + sum(
            a for a, m in zip(adv, mask, strict=True) if m
        )
    return out


@pytest.mark.parametrize("merge", [False, True])
def test_rollout_balance_weighs_a_1_call_and_a_5_call_rollout_the_same(tmp_path: Path, merge: bool) -> None:
    ts = _rollouts()
    token = _weights_per_rollout(tmp_path, "token", ts, merge)
    assert token == {"one": 3.0, "five": 10.0}  # today: every token weighs 1
    rollout = _weights_per_rollout(tmp_path, "rollout", ts, merge)
    assert rollout["one"] == pytest.approx(rollout["five"]) == pytest.approx(13 / 2)  # total kept: 13 tokens
    per_call = balance_weights(ts, range(len(ts)), "transition")
    assert [w * len(t.response_ids) for w, t in zip(per_call, ts, strict=True)] == pytest.approx([13 / 6] * 6)


def test_rollout_balance_holds_with_calls_split_between_agents(tmp_path: Path) -> None:
    ts = _rollouts(agents=("planner", "writer"))
    rollout = _weights_per_rollout(tmp_path, "rollout", ts, merge=True)
    assert rollout["one"] == pytest.approx(rollout["five"])


def test_a_bad_loss_balance_is_refused() -> None:
    import agl

    with pytest.raises(ValueError, match="loss_balance"):
        agl.LightningRL(loss_balance="sample")
