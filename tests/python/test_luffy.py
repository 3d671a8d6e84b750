"""Luffy in the keel package on 4 real ranks (docs/luffy.md): keel.torch's token condensation
against a dense MoE layer computed without Keel (at threshold 1.0 only repeated tokens are
condensed, and outputs and every gradient agree as without condensation; lower thresholds save
more rows), Engine.plan_sequences (the same plan on every rank, sequences sent to their
experts), and keel.condense_rows' rule and argument errors."""

from __future__ import annotations

import functools
from typing import Any, Dict

import pytest

from ranks import run_ranks, static_config, values
from test_dispatcher import EXPERTS, HIDDEN, RANKS, TOKENS, TOP_K, compare_with_dense


def repeated_batch(step: int, rank: int, noise: float):
    """Tokens of which about a third repeat an earlier token (routed like it): exactly when
    noise is 0, else moved by up to `noise` per element."""
    import torch
    g = torch.Generator().manual_seed(500 * step + rank)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g)
    first = torch.randint(0, EXPERTS, (TOKENS,), generator=g)
    second = (first + 1 + torch.randint(0, EXPERTS - 1, (TOKENS,), generator=g)) % EXPERTS
    ids = torch.stack([first, second], dim=1)
    for t in range(1, TOKENS):
        if int(torch.randint(0, 3, (1,), generator=g)) == 0:
            source = t - 1 - int(torch.randint(0, min(t, 4), (1,), generator=g))
            hidden[t] = hidden[source] + noise * (torch.rand(HIDDEN, generator=g) - 0.5)
            ids[t] = ids[source]
    weights = torch.softmax(torch.randn(TOKENS, TOP_K, generator=g), dim=1)
    return hidden, ids, weights


def condensed_against_dense(rank: int, world: int, threshold: float, noise: float,
                            steps: int) -> Dict[str, Any]:
    return compare_with_dense(rank, world, "keel", steps,
                              functools.partial(repeated_batch, noise=noise), threshold)


def test_condensing_repeated_tokens_trains_as_without() -> None:
    results = values(run_ranks(condensed_against_dense, RANKS, 1.0, 0.0, 6))
    for rank, result in enumerate(results):
        for what, error in result["worst"].items():
            assert error < 1e-6, f"rank {rank}: {what} differs by {error} (relative)"
    rows = sum(r["rows"] for r in results)
    kept = sum(r["kept"] for r in results)
    # About a third of the tokens repeat one in the same slot's bucket: rows are saved.
    assert 0 < kept < 0.9 * rows, (kept, rows)
    assert results[0]["epochs"] >= 1, "no placement was committed: replicas were not tested"


def test_a_lower_threshold_condenses_near_repeats_too() -> None:
    exact = values(run_ranks(condensed_against_dense, RANKS, 1.0, 1e-3, 3))
    near = values(run_ranks(condensed_against_dense, RANKS, 0.999, 1e-3, 3))
    kept_exact = sum(r["kept"] for r in exact) / sum(r["rows"] for r in exact)
    kept_near = sum(r["kept"] for r in near) / sum(r["rows"] for r in near)
    # Near repeats are not identical: 1.0 keeps them, 0.999 condenses them.
    assert kept_exact == 1.0, kept_exact
    assert kept_near < 0.9, kept_near
    for result in exact:
        assert max(result["worst"].values()) < 1e-6, result["worst"]
    # Condensing near repeats changes the math, a little: outputs move by about the noise.
    worst = max(r["worst"]["out"] for r in near)
    assert 0 < worst < 1e-2, worst


def plan_on_ranks(rank: int, world: int) -> Dict[str, Any]:
    import torch
    import keel
    from keel.torch import ProcessGroupCommunicator

    config = static_config(world, EXPERTS)
    engine = keel.Engine(ProcessGroupCommunicator(), config=config, num_layers=2,
                         num_experts=EXPERTS, top_k=TOP_K, weight_bytes=8, gradient_bytes=8,
                         optimizer_bytes=8)
    per_rank = EXPERTS // world
    # One sequence per rank whose rows all go to the next rank's experts.
    target = (rank + 1) % world
    rows = torch.zeros(1, 2, EXPERTS, dtype=torch.int32)
    rows[0, :, target * per_rank:(target + 1) * per_rank] = 20
    plan = engine.plan_sequences(0, torch.tensor([40]), rows, max_token_imbalance=1.0)
    traffic = engine.plan_sequences(0, torch.tensor([40]), rows, max_token_imbalance=1.0,
                                    objective="traffic")
    assert traffic.rank.tolist() == plan.rank.tolist()
    bad = None
    try:
        engine.plan_sequences(0, torch.tensor([40]), torch.zeros(1, 2, EXPERTS + 1,
                                                                 dtype=torch.int32))
    except keel.InvalidArgumentError as error:
        bad = str(error)
    engine.close()
    return {"plan": plan, "bad": bad}


def test_plan_sequences_sends_every_sequence_to_its_experts() -> None:
    results = values(run_ranks(plan_on_ranks, RANKS))
    first = results[0]["plan"]
    for result in results:
        plan = result["plan"]
        assert plan.rank.tolist() == first.rank.tolist()
        assert plan.origin_rank.tolist() == list(range(RANKS))
        assert plan.origin_index.tolist() == [0] * RANKS
        assert "expected [1, layers, 8]" in result["bad"], result["bad"]
    # Every rank's sequence moves to the next rank: a rotation keeps one sequence per rank.
    assert first.used and first.moved_sequences == RANKS
    assert first.rank.tolist() == [(r + 1) % RANKS for r in range(RANKS)]
    assert first.seconds_after < first.seconds_before


def test_condense_rows_rule_and_errors() -> None:
    import torch
    import keel

    rows = torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 1.0], [2.0, 4.0], [1.0, 2.0]])
    begin = torch.tensor([0, 4, 5])
    representative, kept = keel.condense_rows(rows, begin, 1.0)
    # Identical rows only, within a bucket: row 3 is parallel to row 0 but not identical, row 4
    # repeats row 0 in another bucket.
    assert representative.tolist() == [0, 0, 2, 3, 4] and kept.tolist() == [3, 1]
    representative, kept = keel.condense_rows(rows, begin, 0.99)
    assert representative.tolist() == [0, 0, 2, 0, 4] and kept.tolist() == [2, 1]
    with pytest.raises(keel.InvalidArgumentError, match="threshold"):
        keel.condense_rows(rows, begin, 1.5)
    with pytest.raises(keel.InvalidArgumentError, match="rows has dtype float64"):
        keel.condense_rows(rows.double(), begin, 1.0)
    with pytest.raises(keel.InvalidArgumentError, match="window"):
        keel.condense_rows(rows, begin, 1.0, window=0)
    with pytest.raises(keel.InvalidArgumentError, match="bucket"):
        keel.condense_rows(rows, torch.tensor([0, 9]), 1.0)
