"""Multi-turn merging: exact prefix extension per agent, breaks, and equality with per-call scoring."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.adapter.trajectories import merge_stats, merge_transitions, token_advantages
from agl.types import Transition


def tr(
    index: int,
    prompt: list[int],
    response: list[int],
    *,
    agent: str | None = "writer",
    rollout: str = "ro-1",
    attempt: int = 1,
    exact: bool = True,
    logprobs: bool = True,
    reward: float = 0.0,
) -> Transition:
    return Transition(
        rollout_id=rollout,
        attempt=attempt,
        agent=agent,
        index=index,
        prompt_ids=tuple(prompt),
        response_ids=tuple(response),
        response_logprobs=tuple(-0.1 * (k + 1) for k in range(len(response))) if logprobs else None,
        exact=exact,
        reward=reward,
        span_id=f"{index + 1:016x}",
    )


def conversation(turns: int, *, agent: str = "writer", start: int = 0, seed: int = 0) -> list[Transition]:
    """An agent's calls whose prompts each re-send the whole history plus a new context chunk."""
    rng = random.Random(seed)
    history = [rng.randrange(5, 60) for _ in range(rng.randrange(3, 8))]
    out = []
    for k in range(turns):
        response = [rng.randrange(5, 60) for _ in range(rng.randrange(1, 5))]
        out.append(tr(start + k, list(history), response, agent=agent))
        history = history + response + [rng.randrange(5, 60) for _ in range(rng.randrange(1, 4))]
    return out


def test_exact_extension_makes_one_sequence_with_masks_and_segments() -> None:
    ts = conversation(4)
    (traj,), stats = merge_transitions(ts)
    assert traj.prompt_ids == ts[0].prompt_ids
    full = traj.prompt_ids + traj.completion_ids
    # the last call's prompt + response is the whole sequence
    assert full == ts[-1].prompt_ids + ts[-1].response_ids
    for seg, t in zip(traj.segments, ts, strict=True):
        assert traj.completion_ids[seg.start : seg.end] == t.response_ids
        assert all(traj.loss_mask[k] == 1 for k in range(seg.start, seg.end))
        assert traj.logprobs is not None and traj.logprobs[seg.start : seg.end] == t.response_logprobs
        assert seg.span_id == t.span_id
    assert traj.response_tokens == sum(len(t.response_ids) for t in ts)
    assert stats.merged_calls == 3 and stats.sequences == 1 and stats.merge_rate == 1.0
    assert stats.tokens_merged == traj.tokens < stats.tokens_per_call


def test_broken_prefix_starts_a_new_sequence_and_counts_the_cause() -> None:
    ts = conversation(3)
    truncated = tr(3, list(ts[0].prompt_ids) + [99], [7, 8])
    diverged = tr(4, [1, 2, 3] + list(ts[2].prompt_ids) + list(ts[2].response_ids) + [50], [9])
    retok = tr(5, list(ts[2].prompt_ids) + list(ts[2].response_ids) + [51], [4], exact=False)
    trajs, stats = merge_transitions([*ts, truncated, diverged, retok])
    # retok extends by ids, but re-tokenised ids make the whole sequence inexact
    assert len(trajs) == 3
    assert stats.breaks == {"truncated": 1, "diverged": 1}
    assert not trajs[0].exact
    assert sum(len(t.segments) for t in trajs) == 6


def test_retokenised_break_is_named() -> None:
    a = tr(0, [1, 2, 3], [4], exact=False)
    b = tr(1, [9, 9, 9, 9], [5])
    _, stats = merge_transitions([a, b])
    assert stats.breaks == {"retokenised": 1}


def _with_messages(t: Transition, *messages: tuple[str, str]) -> Transition:
    return t.model_copy(update={"messages": tuple({"role": r, "content": c} for r, c in messages)})


def test_break_causes_from_the_messages() -> None:
    """With the calls' messages the cause is named from them: the same conversation re-sent with
    other ids is a template re-render; the same opening with history cut is truncation; another
    system prompt or first question is a new conversation."""
    sys_, q = ("system", "You write SQL."), ("user", "How many rows?")
    first = _with_messages(tr(0, [1, 2, 3], [4, 5]), sys_, q)
    # the history re-sent unchanged plus a tool result, but the ids do not continue [1, 2, 3, 4, 5]
    rerendered = _with_messages(tr(1, [1, 2, 3, 4, 6, 7], [8]), sys_, q, ("assistant", "x"), ("tool", "3"))
    truncated = _with_messages(tr(2, [1, 2, 3, 9], [8]), sys_, q, ("user", "summary so far"))
    fresh = _with_messages(tr(3, [1, 2, 3, 10], [8]), sys_, ("user", "Another question"))
    _, stats = merge_transitions([first, rerendered])
    assert stats.breaks == {"rerendered": 1}
    # with the sampled text known: the reply re-sent as sampled is a re-render, changed is an edit
    said = first.model_copy(update={"response_text": "x"})
    edited = _with_messages(rerendered, sys_, q, ("assistant", "x\nObservation: 3"), ("user", "go on"))
    assert merge_transitions([said, rerendered])[1].breaks == {"rerendered": 1}
    assert merge_transitions([said, edited])[1].breaks == {"edited": 1}
    _, stats = merge_transitions([first, truncated])
    assert stats.breaks == {"truncated": 1}
    again = _with_messages(tr(4, [1, 2, 3], [8]), sys_, q)  # the same prompt asked again: a fresh start
    assert merge_transitions([first, again])[1].breaks == {"diverged": 1}
    trajs, stats = merge_transitions([first, fresh])
    assert stats.breaks == {"diverged": 1}
    assert [seg.break_cause for t in trajs for seg in t.segments] == [None, "diverged"]


def test_merge_stats_counts_what_merge_transitions_does() -> None:
    ts = [*conversation(4), *conversation(2, agent="checker", start=4, seed=3)]
    ts.append(tr(6, [1, 2], [3], agent="checker"))
    _, full = merge_transitions(ts)
    assert merge_stats(ts).as_dict() == full.as_dict()
    assert (full.merged_calls, full.sequences, full.breaks) == (4, 3, {"diverged": 1})
    assert full.merge_rate == pytest.approx(4 / 5)


def test_two_agents_never_share_a_sequence() -> None:
    w = conversation(3, agent="writer")
    # the checker's prompt extends the writer's history exactly, but it is another agent
    c = tr(3, list(w[-1].prompt_ids) + list(w[-1].response_ids) + [42], [43], agent="checker")
    trajs, _ = merge_transitions([*w, c])
    assert {t.agent: len(t.segments) for t in trajs} == {"writer": 3, "checker": 1}


def test_attempts_and_rollouts_never_share_a_sequence() -> None:
    a = conversation(2)
    b = [t.model_copy(update={"attempt": 2, "index": t.index + 2}) for t in conversation(2)]
    c = [t.model_copy(update={"rollout_id": "ro-2"}) for t in conversation(2)]
    trajs, _ = merge_transitions([*a, *b, *c])
    assert len(trajs) == 3


def test_one_agent_with_two_conversations_extends_each() -> None:
    x = conversation(3, seed=1)
    y = [t.model_copy(update={"index": t.index + 3}) for t in conversation(3, seed=2)]
    interleaved = [
        t.model_copy(update={"index": k}) for k, t in enumerate([x[0], y[0], x[1], y[1], x[2], y[2]])
    ]
    trajs, stats = merge_transitions(interleaved)
    assert len(trajs) == 2 and stats.merged_calls == 4
    assert stats.breaks == {"diverged": 1}  # the second conversation's first call


def test_missing_logprobs_make_the_sequence_logprob_free() -> None:
    ts = conversation(2)
    ts[1] = ts[1].model_copy(update={"response_logprobs": None})
    (traj,), _ = merge_transitions(ts)
    assert traj.logprobs is None


def test_token_advantages_follow_segments() -> None:
    ts = conversation(3)
    (traj,), _ = merge_transitions(ts)
    adv = token_advantages(traj, [1.0, -2.0, 0.5])
    for seg, a in zip(traj.segments, [1.0, -2.0, 0.5], strict=True):
        assert adv[seg.start : seg.end] == [a] * (seg.end - seg.start)
    assert all(adv[k] == 0.0 for k, m in enumerate(traj.loss_mask) if m == 0)


@st.composite
def call_trees(draw: st.DrawFn) -> list[Transition]:
    """Random attempts: several agents, each with conversations that sometimes extend and sometimes break."""
    agents = draw(st.lists(st.sampled_from(["a", "b", "c", None]), min_size=1, max_size=3, unique=True))
    out: list[Transition] = []
    histories: dict[str | None, list[list[int]]] = {a: [] for a in agents}
    for index in range(draw(st.integers(1, 12))):
        agent = draw(st.sampled_from(agents))
        convs = histories[agent]
        choice = draw(st.integers(0, 3))
        if convs and choice < 3:
            hist = convs[draw(st.integers(0, len(convs) - 1))]
            if choice == 2 and len(hist) > 1:  # truncate the history
                hist[:] = hist[: len(hist) // 2]
        else:
            hist = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
            convs.append(hist)
        response = draw(st.lists(st.integers(0, 50), min_size=1, max_size=4))
        out.append(tr(index, list(hist), response, agent=agent, exact=draw(st.booleans())))
        hist.extend(response + draw(st.lists(st.integers(0, 50), max_size=3)))
    return out


@settings(max_examples=200, deadline=None)
@given(call_trees())
def test_every_call_lands_in_exactly_one_segment_with_its_own_tokens(ts: list[Transition]) -> None:
    trajs, stats = merge_transitions(ts)
    seen = sorted(seg.transition for t in trajs for seg in t.segments)
    assert seen == list(range(len(ts)))
    for traj in trajs:
        full = traj.prompt_ids + traj.completion_ids
        for seg in traj.segments:
            t = ts[seg.transition]
            assert t.agent == traj.agent and t.rollout_id == traj.rollout_id
            assert traj.completion_ids[seg.start : seg.end] == t.response_ids
            # the tokens before the response are exactly the call's prompt: same context, same logprobs
            assert full[: len(traj.prompt_ids) + seg.start] == t.prompt_ids
    assert stats.tokens_merged <= stats.tokens_per_call
    assert 0.0 <= stats.merge_rate <= 1.0


def test_merged_logprobs_equal_per_call_logprobs_on_a_real_model() -> None:
    """Causal LM: each response token sees the same tokens in the merged sequence as in its own call."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    ).eval()

    def logprobs(ids: list[int], start: int, end: int) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        return [float(lp[k - 1, ids[k]]) for k in range(start, end)]

    ts = conversation(5, seed=3)
    (traj,), _ = merge_transitions(ts)
    full = list(traj.prompt_ids + traj.completion_ids)
    p = len(traj.prompt_ids)
    for seg in traj.segments:
        t = ts[seg.transition]
        own = list(t.prompt_ids + t.response_ids)
        per_call = logprobs(own, len(t.prompt_ids), len(own))
        merged = logprobs(full, p + seg.start, p + seg.end)
        assert merged == pytest.approx(per_call, abs=1e-5)


def _conversation_with_logprobs(update, turns: int, seed: int) -> list[Transition]:
    """A conversation whose recorded logprobs are the policy's own (as the gateway records them)."""
    base = conversation(turns, seed=seed)
    lps = update.response_logprobs(base)
    return [t.model_copy(update={"response_logprobs": tuple(lp)}) for t, lp in zip(base, lps, strict=True)]


def test_merged_update_equals_the_per_call_update(tmp_path) -> None:
    """The loss and the resulting weights of one update on merged sequences equal the per-call ones."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    from agl.algorithms.lightning_rl import LightningRL
    from agl.algorithms.update import PolicyUpdate
    from agl.config import RunConfig
    from agl.trainer.trainer import load_tokenizer

    torch.set_num_threads(1)
    tok = load_tokenizer()

    def make(sub: str) -> PolicyUpdate:
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=49152,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                tie_word_embeddings=True,
            )
        )
        algo = LightningRL(
            learning_rate=5e-3, lora_r=8, lora_alpha=16, micro_batch_tokens=64, mixed_precision="no"
        )
        return PolicyUpdate(model, tok, RunConfig.resolve(algo), output_dir=tmp_path / sub, seed=0)

    merged_up, per_call_up = make("a"), make("b")
    ts = _conversation_with_logprobs(merged_up, 4, seed=5)
    other = [
        t.model_copy(update={"agent": "checker", "index": t.index + 4})
        for t in _conversation_with_logprobs(merged_up, 3, seed=6)
    ]
    ts = ts + other
    advantages = [1.0, -0.5, 0.0, 2.0, -1.0, 0.5, 0.25]
    m1 = merged_up.step(ts, advantages, merge_turns=True)
    m2 = per_call_up.step(ts, advantages, merge_turns=False)
    assert m1["sequences"] == 2 and m2["sequences"] == 6  # the zero-advantage call is left out
    assert m1["trained_transitions"] == m2["trained_transitions"] == 6
    assert m1["response_tokens"] == m2["response_tokens"]
    assert m1["update_tokens"] < m2["update_tokens"]
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-5)
    assert m1["behaviour_ratio_dev"] < 1e-4
    for (name, p1), (_, p2) in zip(
        merged_up.model.named_parameters(), per_call_up.model.named_parameters(), strict=True
    ):
        if p1.requires_grad:
            assert torch.allclose(p1, p2, atol=1e-5), name
