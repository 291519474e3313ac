"""Decoupled PPO (``off_policy="tis"``) on a tiny random Llama: the truncated importance weights equal
``min(pi_theta / pi_behaviour, cap)`` computed by hand from the model's own logits, the clip fraction
is the share of tokens at the cap, and a stale transition that plain PPO clips away still trains."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from test_update import make, tr  # noqa: E402

from agl.algorithms.offpolicy import decoupled_weights, truncated_weights  # noqa: E402
from agl.trainer.trainer import load_tokenizer  # noqa: E402

CAP = 2.0
#: behaviour = pi_theta - offset: ratios e^1 (truncated), e^-0.5, e^0.2 (kept), cycled over the tokens
OFFSETS = (1.0, -0.5, 0.2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def hand_logprobs(up, t) -> list[float]:
    """log pi_theta of each response token, from the policy's full logits (no agl scoring code)."""
    ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)], device=up.device)
    with torch.no_grad():
        logits = up.model(input_ids=ids).logits[0].float() / up.config.temperature
    lp = torch.log_softmax(logits, dim=-1)
    n = len(t.prompt_ids)
    return [float(lp[n - 1 + i, tok_id]) for i, tok_id in enumerate(t.response_ids)]


def test_tis_weights_equal_a_hand_computation(tok, tmp_path) -> None:
    up = make(tok, tmp_path)
    ts = [tr(tok, "hello", "some response text", "r1"), tr(tok, "what is two", "four, I think", "r2")]
    behaviours, hand_w = [], []
    for t in ts:
        lp = hand_logprobs(up, t)
        mu = [x - OFFSETS[i % 3] for i, x in enumerate(lp)]
        behaviours.append(t.model_copy(update={"response_logprobs": tuple(mu)}))
        hand_w.append([min(math.exp(a - b), CAP) for a, b in zip(lp, mu, strict=True)])
    plan = up._plan(behaviours, [1.0, -1.0], False)
    dw = decoupled_weights(up, plan, CAP)
    got: dict[int, list[float]] = {}
    for k, mb in enumerate(plan.mbs):
        for row, i in enumerate(mb.rows):
            got[plan.seqs[i].segments[0].transition] = dw.weights[k][row, : len(ts[i].response_ids)].tolist()
    for i in range(len(ts)):
        assert got[i] == pytest.approx(hand_w[i], rel=1e-4, abs=1e-5)
    n_tok = sum(len(w) for w in hand_w)
    clipped = sum(1 for w in hand_w for x in w if x == CAP)
    assert 0 < clipped < n_tok and dw.tokens == n_tok and dw.clipped == clipped
    # the deviation the plain path reports, here the proximal policy's against the behaviour's: e^1 - 1
    assert dw.max_dev == pytest.approx(math.e - 1.0, rel=1e-4)
    # the step reports the same fraction and deviation (not the ~0 of the ratio against the proximal)
    m = up.step(behaviours, [1.0, -1.0], tis_cap=CAP)
    assert m["tis_clip_fraction"] == pytest.approx(clipped / n_tok)
    assert m["behaviour_ratio_dev"] == pytest.approx(math.e - 1.0, rel=1e-4)


def test_truncated_weights_cap_and_flag() -> None:
    w, clipped = truncated_weights(torch.tensor([0.0, 1.0, -1.0]), torch.tensor([0.0, 0.0, 0.0]), 2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, math.exp(-1.0)])
    assert clipped.tolist() == [False, True, False]


def test_a_stale_transition_plain_ppo_clips_away_still_trains_under_tis(tok, tmp_path) -> None:
    """Behaviour log-probs 1 nat below the policy's: PPO's ratio e^1 clips every token (no gradient);
    decoupled PPO takes the ratio against the proximal policy (1) and weights by min(e^1, cap) = cap."""
    t = tr(tok, "hello", "some response text", "r")
    plain = make(tok, tmp_path / "plain")
    stale = t.model_copy(update={"response_logprobs": tuple(x - 1.0 for x in hand_logprobs(plain, t))})
    m = plain.step([stale], [1.0])
    assert m["clip_fraction"] == pytest.approx(1.0) and m["grad_norm"] == pytest.approx(0.0, abs=1e-8)
    tis = make(tok, tmp_path / "tis")
    m = tis.step([stale], [1.0], tis_cap=CAP)
    assert m["tis_clip_fraction"] == pytest.approx(1.0) and m["clip_fraction"] == 0.0
    assert m["grad_norm"] > 0


def test_tis_equals_plain_ppo_with_the_advantage_scaled_by_the_weight(tok, tmp_path) -> None:
    """A uniform ratio 1.5 (< cap): decoupled PPO with advantage 1 moves the policy exactly as on-policy
    PPO (behaviour = policy) with advantage 1.5."""
    t = tr(tok, "hello", "some response text", "r")
    a, b = make(tok, tmp_path / "a"), make(tok, tmp_path / "b")
    lp = hand_logprobs(a, t)
    off = t.model_copy(update={"response_logprobs": tuple(x - math.log(1.5) for x in lp)})
    on = t.model_copy(update={"response_logprobs": tuple(lp)})
    before = a.merged_state_dict()
    ma = a.step([off], [1.0], tis_cap=CAP)
    b.step([on], [1.5])
    assert ma["tis_weight_mean"] == pytest.approx(1.5, rel=1e-4) and ma["tis_clip_fraction"] == 0.0
    sa, sb = a.merged_state_dict(), b.merged_state_dict()
    assert max((sa[k] - sb[k]).abs().max().item() for k in sa) < 1e-6
    assert max((sa[k] - before[k]).abs().max().item() for k in sa) > 1e-4  # the update moved it
