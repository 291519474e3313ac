"""Shared-prefix planning (agl.algorithms.prefix_tree, agl.algorithms.packing): which sequences share a
row, the tree's layout, and the micro-batches sized by tree tokens. Pure Python (runs without torch);
the exactness of the packed forward is in test_prefix_sharing.py."""

from __future__ import annotations

import random

import pytest

from agl.adapter.trajectories import Trajectory
from agl.algorithms.packing import pack_micro_batches
from agl.algorithms.prefix_tree import TreeRow, common_prefix, joins, pair_cost, plan_rows


def seq(prompt: tuple[int, ...], tail: tuple[int, ...], rid: str = "r", logprobs: bool = False) -> Trajectory:
    return Trajectory(
        rollout_id=rid,
        attempt=1,
        prompt_ids=prompt,
        completion_ids=tail,
        loss_mask=(1,) * len(tail),
        logprobs=(0.0,) * len(tail) if logprobs else None,
        segments=(),
    )


def ancestors(row: TreeRow) -> dict[int, set[int]]:
    """Row position -> the row positions of the tokens before it in its own sequence (from the paths)."""
    out: dict[int, set[int]] = {}
    for path in row.paths:
        for k, node in enumerate(path):
            before = set(path[:k])
            assert out.setdefault(node, before) == before  # a node has one history, whoever reaches it
    return out


def test_common_prefix_is_the_longest_shared_run() -> None:
    assert common_prefix((1, 2, 3, 4), (1, 2, 9)) == 2
    assert common_prefix((1, 2), (1, 2, 3)) == 2
    assert common_prefix((5,), (6,)) == 0
    assert common_prefix((), (1,)) == 0
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = [rng.randrange(3) for _ in range(rng.randrange(12))]
        naive = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == naive


def test_a_group_shares_its_prompt_once_and_each_member_keeps_its_own_history() -> None:
    prompt = tuple(range(100, 140))
    tails = [(1, 2, 3), (1, 2, 4, 5), (7,), (1, 2, 3)]  # nested sharing, and one member twice
    seqs = {i: prompt + t for i, t in enumerate(tails)}
    [row], alone = plan_rows(seqs, budget=4096, cost=1 / 3072)
    assert alone == [] and sorted(row.members) == [0, 1, 2, 3]
    # the prompt once, then (1, 2) once, then 3 once (members 0 and 3 are identical), 4 5, and 7
    assert row.tokens == 40 + 2 + 1 + 2 + 1
    hist = ancestors(row)
    for i, path in zip(row.members, row.paths, strict=True):
        assert [row.ids[n] for n in path] == list(seqs[i])  # the member's tokens, in order
        assert [row.positions[n] for n in path] == list(range(len(seqs[i])))  # positions continue
        assert all(hist[path[k]] == set(path[:k]) for k in range(len(path)))


def test_sharing_only_a_few_template_tokens_does_not_pay() -> None:
    """Long sequences that share a 10-token header are cheaper apart: the joined row's attention would
    cost more than the tokens saved."""
    header = tuple(range(10))
    seqs = {i: header + tuple(range(1000 * (i + 1), 1000 * (i + 1) + 2000)) for i in range(3)}
    rows, alone = plan_rows(seqs, budget=8192, cost=1 / 3072)
    assert rows == [] and sorted(alone) == [0, 1, 2]
    assert not joins(2010, 2010, 10, 8192, 1 / 3072)
    assert joins(1200, 1200, 1000, 8192, 1 / 3072)  # a shared 1,000-token prompt does


def test_rows_stay_within_the_budget() -> None:
    prompt = tuple(range(500, 800))
    seqs = {i: prompt + tuple(range(10 * i, 10 * i + 100)) for i in range(12)}
    rows, alone = plan_rows(seqs, budget=700, cost=1 / 3072)
    assert all(r.tokens <= 700 for r in rows)
    assert sorted([i for r in rows for i in r.members] + alone) == list(range(12))  # each exactly once
    assert [len(r.members) for r in rows][:2] == [4, 4]  # 300 + 4 x 100 fits, a fifth would not


def test_pair_cost_from_the_model_shape() -> None:
    class Cfg:  # SmolLM2-135M's shape
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim = (
            576,
            1536,
            9,
            3,
            64,
        )

    assert pair_cost(Cfg()) == pytest.approx(1 / 3072)
    assert pair_cost(object()) == pytest.approx(1 / 3072)  # unknown shape: the default


def test_micro_batches_count_tree_tokens_and_never_mix_behaviour_sources() -> None:
    prompt = tuple(range(1000, 1200))
    group = [seq(prompt, tuple(range(10 * i, 10 * i + 50)), f"g{i}", logprobs=True) for i in range(8)]
    other = [seq(tuple(range(3000 + 300 * i, 3000 + 300 * i + 150)), (1, 2, 3), f"o{i}") for i in range(2)]
    items = group + other
    flat = pack_micro_batches(items, 512)
    shared = pack_micro_batches(items, 512, share_cost=1 / 3072)
    flat_tokens = sum(t.tokens for t in items)
    assert sum(mb.tokens for mb in flat) == flat_tokens
    # the group's 8 x 250 tokens become one prompt + 8 tails: 600 tokens in two rows instead of 2,000
    trees = [mb for mb in shared if mb.tree is not None]
    assert sum(mb.tokens for mb in trees) == 2 * 200 + 8 * 50
    assert all(mb.padded_tokens <= 512 for mb in shared)
    assert len(shared) < len(flat)
    # every sequence lands in exactly one micro-batch; trees hold only the engine-log-prob sequences
    assert sorted(i for mb in shared for i in mb.rows) == list(range(len(items)))
    assert all(mb.has_logprobs == all(items[i].logprobs is not None for i in mb.rows) for mb in shared)
    assert {i for mb in trees for i in mb.rows} == set(range(8))


def test_a_sequence_without_prompt_tokens_packs_flat() -> None:
    items = [seq((), (1, 2, 3)), seq((), (1, 2, 4))]
    mbs = pack_micro_batches(items, 512, share_cost=1 / 3072)
    assert all(mb.tree is None for mb in mbs)
