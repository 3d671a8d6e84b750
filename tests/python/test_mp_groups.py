"""Parm's de-duplicated dispatch in the keel package on 4 real ranks.

The engine: with ``Engine(mp_group_size=2)`` every member of a pair passes the pair's tokens,
routes only its half (``Route.share_begin``, ``share_end``; the other half's slots are -1) and
gets exactly the slots and splits it gets when it passes its own tokens alone; a group size that
does not divide the node's ranks is an error naming it.

keel.torch: ``KeelMoE(mp_group_size=2)`` trains a layer of pairs that hold the same tokens as
the same layer without MP groups trains each pair's tokens once (each member taking its share,
``[m * T // 2, (m + 1) * T // 2)`` of the pair's T = 95 tokens), under the static placement
(KeelMoE makes the pairs' groups) and the keel placement with replicas and transient slots (the
trainer's own pair groups passed as ``mp_group``), half the steps under activation
checkpointing. The model's objective is the same in both runs: the average over data-parallel
replicas of each replica's loss, 4 ranks holding a share each, or 2 pairs holding a pair's
tokens each, so a pair's loss is half the sum of its members' (``0.5 * sum``). Then, bitwise:
the outputs are the pair's outputs without MP groups; each member's gradient of ``hidden`` and
``topk_weights`` is the whole pair's (half of what the two ranks without MP groups get, the
pair's loss being half of theirs); each home's gradient (the homes average over the 2
replicas) and the weights after Adam are those without MP groups; each member sends exactly the
rows of its share. Against a dense float64 layer on the pair's tokens, relative 1e-6. Bad
``mp_group_size`` and ``mp_group`` values, and members that pass different tokens, fail every
rank with an error naming the argument."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from ranks import DEVICES, run_ranks, static_config, values

RANKS = 4
EXPERTS = 8
TOP_K = 2
TOKENS = 24


def own_ids(rank: int):
    """Rank `rank`'s own [TOKENS, TOP_K] expert ids, a few choices dropped."""
    import torch
    t = torch.arange(TOKENS)
    first = (t * 3 + rank) % EXPERTS
    second = (first + 1 + t % 3) % EXPERTS
    second[t % 7 == 0] = -1
    return torch.stack([first, second], dim=1).to(torch.int32)


def route_on_ranks(rank: int, world: int, mp_group_size: int) -> Dict[str, Any]:
    import torch
    import keel
    from keel.torch import ProcessGroupCommunicator

    config = static_config(world, EXPERTS)
    engine = keel.Engine(ProcessGroupCommunicator(), config=config, num_layers=1,
                         num_experts=EXPERTS, top_k=TOP_K, weight_bytes=8, gradient_bytes=8,
                         mp_group_size=mp_group_size)
    buffers = [(torch.zeros(2), torch.zeros(2)) for _ in range(engine.local_slots)]
    for local, (weights, gradients) in enumerate(buffers):
        engine.register_slot(0, local, weights, gradients, None)
    first = rank - rank % mp_group_size
    ids = torch.cat([own_ids(member) for member in range(first, first + mp_group_size)])
    route = engine.route(0, ids)
    engine.close()
    return {"slot": route.slot, "send_counts": route.send_counts,
            "recv_totals": route.recv_totals, "share": (route.share_begin, route.share_end)}


def bad_group_on_ranks(rank: int, world: int) -> str:
    import keel
    from keel.torch import ProcessGroupCommunicator

    config = keel.Config.from_dict({"topology": {"num_nodes": 1, "gpus_per_node": world}})
    try:
        keel.Engine(ProcessGroupCommunicator(), config=config, num_layers=1,
                    num_experts=EXPERTS, top_k=TOP_K, weight_bytes=8, gradient_bytes=8,
                    mp_group_size=3)
    except keel.InvalidArgumentError as error:
        return str(error)
    return "created"


def test_a_pair_routes_its_shares_as_without_groups() -> None:
    plain = values(run_ranks(route_on_ranks, RANKS, 1))
    pairs = values(run_ranks(route_on_ranks, RANKS, 2))
    for rank in range(RANKS):
        member = rank % 2
        assert plain[rank]["share"] == (0, TOKENS)
        assert pairs[rank]["share"] == (member * TOKENS, (member + 1) * TOKENS)
        slot = pairs[rank]["slot"]
        assert slot.shape == (2 * TOKENS, TOP_K)
        mine = slot[member * TOKENS:(member + 1) * TOKENS]
        other = slot[(1 - member) * TOKENS:(2 - member) * TOKENS]
        assert mine.tolist() == plain[rank]["slot"].tolist(), rank
        assert (other == -1).all(), rank
        assert pairs[rank]["send_counts"].tolist() == plain[rank]["send_counts"].tolist()
        assert pairs[rank]["recv_totals"].tolist() == plain[rank]["recv_totals"].tolist()


def test_a_group_size_that_does_not_divide_the_node_is_named() -> None:
    for message in values(run_ranks(bad_group_on_ranks, RANKS)):
        assert "mp_group_size = 3" in message and "gpus_per_node = 4" in message, message


# --- keel.torch.KeelMoE with MP groups -----------------------------------------------------------

HIDDEN = 16
FFN = 24
PAIR_TOKENS = 95  # odd: the members' shares differ by a token (47 and 48)
STEPS = 8


def pair_batch(step: int, pair: int):
    """The pair's tokens, router ids (skewed toward two hot experts that drift, a choice
    dropped), gate weights and the probe its loss is taken against."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + pair)
    hidden = torch.randn(PAIR_TOKENS, HIDDEN, generator=g)
    hot = torch.tensor([(step // 3) % EXPERTS, (step // 3 + 3) % EXPERTS])
    first = torch.where(torch.rand(PAIR_TOKENS, generator=g) < 0.7,
                        hot[torch.randint(0, 2, (PAIR_TOKENS,), generator=g)],
                        torch.randint(0, EXPERTS, (PAIR_TOKENS,), generator=g))
    second = (first + 1 + torch.randint(0, EXPERTS - 1, (PAIR_TOKENS,), generator=g)) % EXPERTS
    ids = torch.stack([first, second], dim=1)
    ids[5, 1] = -1
    weights = torch.softmax(torch.randn(PAIR_TOKENS, TOP_K, generator=g), dim=1)
    probe = torch.randn(PAIR_TOKENS, HIDDEN, generator=g)
    return hidden, ids, weights, probe


def share_of(member: int, tokens: int = PAIR_TOKENS) -> slice:
    return slice(tokens * member // 2, tokens * (member + 1) // 2)


def train_layer(rank: int, policy: str, mp: str, device: str) -> Dict[str, Any]:
    """STEPS steps of one layer with Adam. ``mp``: "off" (this rank trains its share of its
    pair's tokens), "made" (mp_group_size=2, KeelMoE makes the groups) or "given" (the pairs'
    groups passed as mp_group), the last two under checkpointing on odd steps. Returns per step
    the output, the input gradients, the route's send counts and slots, every home gradient of
    this rank; the final home weights; what the placement used; and (with MP groups) the largest
    difference from a dense float64 layer on the pair's tokens."""
    import torch
    import torch.distributed as dist
    import torch.utils.checkpoint
    import keel.torch as kt
    from test_dispatcher import dense_reference, moe_config

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    options: Dict[str, Any] = {}
    if mp != "off":
        options["mp_group_size"] = 2
    if mp == "given":
        options["mp_group"] = pairs[rank // 2]
    spec = kt.ffn_expert(HIDDEN, FFN)
    moe = kt.KeelMoE(spec, num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                     config=moe_config(policy), seed=11, device=device, **options)
    layer = moe.layer(0)
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-2, fused=device == "cuda")
    moe.attach(optimizer)
    pair, member = divmod(rank, 2)
    steps: List[Dict[str, Any]] = []
    worst = {"out": 0.0, "hidden": 0.0, "weights": 0.0, "experts": 0.0}

    def note(what: str, got: Any, want: Any) -> None:
        scale = 1.0 + float(want.abs().max())
        worst[what] = max(worst[what], float((got.double() - want).abs().max()) / scale)

    used = {"replicas": 0, "transient_rows": 0}
    for step in range(STEPS):
        hidden, ids, weights, probe = pair_batch(step, pair)
        experts = moe.gather_experts(0)
        if mp == "off":
            mine = share_of(member)
            hidden, ids, weights, probe = hidden[mine], ids[mine], weights[mine], probe[mine]
        x = hidden.to(device, copy=True).requires_grad_(True)
        w = weights.to(device, copy=True).requires_grad_(True)
        if mp != "off" and step % 2 == 1:
            out = torch.utils.checkpoint.checkpoint(layer, x, ids.to(device), w,
                                                    use_reentrant=False)
        else:
            out = layer(x, ids.to(device), w)
        # One objective: the mean over data-parallel replicas of each replica's loss.
        loss = (out * probe.to(device)).sum() * (0.5 if mp != "off" else 1.0)
        loss.backward()
        route = layer.last_route
        transient = list(range(moe.engine.slots_per_rank, moe.engine.local_slots))
        used["transient_rows"] += int(route.recv_counts[:, transient].sum())
        used["replicas"] += int((moe.engine.placement(0)["logcnt"] > 1).sum())
        moe.reduce_gradients()
        homes = {e: {n: p.grad.to("cpu", copy=True) for n, p in params.items()}
                 for e, params in layer.home_parameters().items()}
        out, x_grad, w_grad = out.detach().cpu(), x.grad.cpu(), w.grad.cpu()
        if mp != "off":
            ref_x = hidden.double().requires_grad_(True)
            ref_w = weights.double().requires_grad_(True)
            ref_out, ref_params = dense_reference(spec, experts, ref_x, ids, ref_w,
                                                  0.5 * probe.double())
            note("out", out, ref_out.detach())
            note("hidden", x_grad, ref_x.grad)
            note("weights", w_grad, ref_w.grad)
            # Each pair's tokens once (its first member's), averaged over the 2 replicas.
            for e in range(EXPERTS):
                for name in spec.names:
                    grad = ref_params[e][name].grad * (1.0 if member == 0 else 0.0)
                    dist.all_reduce(grad)
                    ref_params[e][name].grad = grad * 0.5
            for e, grads in homes.items():
                for name, grad in grads.items():
                    note("experts", grad, ref_params[e][name].grad)
        steps.append({"out": out, "hidden": x_grad, "weights": w_grad,
                      "send_counts": route.send_counts.clone(), "slot": route.slot.cpu(),
                      "share": (route.share_begin, route.share_end),
                      "ids": ids.clone(), "homes": homes})
        optimizer.step()
        optimizer.zero_grad()
    final = {e: {n: p.detach().cpu() for n, p in params.items()}
             for e, params in layer.home_parameters().items()}
    epochs = moe.stats()["epochs_committed"]
    moe.close()
    return {"steps": steps, "final": final, "used": used, "epochs": epochs, "worst": worst}


def train_with_and_without_groups(rank: int, world: int, policy: str, mp: str,
                                  device: str) -> Dict[str, Any]:
    return {"mp": train_layer(rank, policy, mp, device),
            "off": train_layer(rank, policy, "off", device)}


def assert_equal(got: Any, want: Any, what: str) -> None:
    import torch
    assert got.shape == want.shape and torch.equal(got, want), (
        f"{what} differs by {float((got.double() - want.double()).abs().max())}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy, mp", [("static", "made"), ("keel", "given")])
def test_keel_moe_pairs_train_as_their_tokens_once(policy: str, mp: str, device: str) -> None:
    import torch
    by_rank = values(run_ranks(train_with_and_without_groups, RANKS, policy, mp, device,
                               timeout=300, device=device))
    for rank, result in enumerate(by_rank):
        for what, error in result["mp"]["worst"].items():
            assert error < 1e-6, f"rank {rank}: {what} differs from the dense layer by {error}"
    for pair in range(RANKS // 2):
        members = [by_rank[2 * pair + m] for m in range(2)]
        for step in range(STEPS):
            alone = [m["off"]["steps"][step] for m in members]
            for member, result in enumerate(members):
                got = result["mp"]["steps"][step]
                where = f"step {step}, rank {2 * pair + member}"
                assert_equal(got["out"], torch.cat([a["out"] for a in alone]), f"{where}: out")
                for grad in ("hidden", "weights"):
                    want = 0.5 * torch.cat([a[grad] for a in alone])
                    assert_equal(got[grad], want, f"{where}: the gradient of {grad}")
                # The member dispatches its share's rows, exactly as it would alone.
                mine = share_of(member)
                assert got["share"] == (mine.start, mine.stop), where
                rows = int((got["ids"][mine] >= 0).sum())
                assert int(got["send_counts"].sum()) == rows, where
                assert_equal(got["send_counts"], alone[member]["send_counts"],
                             f"{where}: send counts")
                assert_equal(got["slot"][mine], alone[member]["slot"], f"{where}: slots")
                outside = torch.ones(PAIR_TOKENS, dtype=torch.bool)
                outside[mine] = False
                assert (got["slot"][outside] == -1).all(), where
    for step in range(STEPS):
        for rank, result in enumerate(by_rank):
            got, want = result["mp"]["steps"][step]["homes"], result["off"]["steps"][step]["homes"]
            assert sorted(got) == sorted(want), f"step {step}, rank {rank}: homes"
            for e in got:
                for name in got[e]:
                    assert_equal(got[e][name], want[e][name],
                                 f"step {step}, rank {rank}: expert {e}'s {name} gradient")
    for rank, result in enumerate(by_rank):
        for e, params in result["mp"]["final"].items():
            for name, weight in params.items():
                assert_equal(weight, result["off"]["final"][e][name],
                             f"rank {rank}: expert {e}'s {name} after {STEPS} steps")
    used = {k: sum(r["mp"]["used"][k] for r in by_rank) for k in ("replicas", "transient_rows")}
    if policy == "keel":
        assert by_rank[0]["mp"]["epochs"] >= 1, "no placement was committed"
        assert used["replicas"] > 0 and used["transient_rows"] > 0, used
    else:
        assert used == {"replicas": 0, "transient_rows": 0}


def refusals_on_ranks(rank: int, world: int) -> List[str]:
    """Bad mp_group_size and mp_group values, and members passing different tokens; the
    message each raises. Then a good layer call still trains."""
    import torch.distributed as dist
    import keel
    import keel.torch as kt
    from ranks import expect_error

    spec = kt.ffn_expert(HIDDEN, FFN)
    config = static_config(world, EXPERTS)
    messages: List[str] = []

    def make(**options: Any) -> Any:
        return kt.KeelMoE(spec, num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                          **{"config": config, **options})

    error = keel.InvalidArgumentError
    for size in (0, 3, True):
        expect_error(messages, error, lambda: make(mp_group_size=size))
    two_nodes = keel.Config.from_dict({"topology": {"num_nodes": 2, "gpus_per_node": 2},
                                       "migration": {"transport": "ucx"}})
    expect_error(messages, error, lambda: make(mp_group_size=4, config=two_nodes))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    expect_error(messages, error, lambda: make(mp_group=pairs[rank // 2]))
    crossed = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    expect_error(messages, error, lambda: make(mp_group_size=2, mp_group=crossed[rank % 2]))
    expect_error(messages, error, lambda: make(mp_group_size=2, group=pairs[rank // 2],
                                               config=static_config(2, EXPERTS)))

    moe = make(mp_group_size=2)
    layer = moe.layer(0)
    hidden, ids, weights, _ = pair_batch(0, rank // 2)
    short = slice(0, PAIR_TOKENS - 1 if rank == 3 else PAIR_TOKENS)
    expect_error(messages, error, lambda: layer(hidden[short], ids[short], weights[short]))
    other_ids = ids.clone()
    if rank == 1:
        other_ids[7, 0] = (other_ids[7, 0] + 1) % EXPERTS
    expect_error(messages, error, lambda: layer(hidden, other_ids, weights))
    other_hidden = hidden.bfloat16() if rank == 3 else hidden
    expect_error(messages, error, lambda: layer(other_hidden, ids, weights))
    # The refusals left the engine usable.
    x = hidden.clone().requires_grad_(True)
    layer(x, ids, weights).sum().backward()
    moe.reduce_gradients()
    moe.step_end()
    messages.append(f"trained: {x.grad.shape[0]} gradient rows")
    moe.close()
    return messages


def test_bad_mp_groups_are_refused_by_name() -> None:
    by_rank = values(run_ranks(refusals_on_ranks, RANKS))
    for rank, messages in enumerate(by_rank):
        expected = [
            "mp_group_size = 0 is not a positive integer",
            "mp_group_size = 3 does not divide the group's 4 ranks",
            "mp_group_size = True is not a positive integer",
            "mp_group_size = 4 does not divide topology.gpus_per_node = 2",
            "mp_group is given but mp_group_size = 1",
            # Rank 0's verdict, on every rank.
            "mp_group on rank 0 holds the job's ranks [0, 2]; its MP group is the job's ranks "
            "[0, 1]",
            "mp_group_size = 2 over a group of 2 of the job's 4 processes needs mp_group",
            "layer 0: hidden has 95 tokens on rank 2 and 94 on rank 3",
            "layer 0: topk_ids differ between rank 0 and rank 1",
            "layer 0: hidden is float32 on rank 2 and bfloat16 on rank 3",
            f"trained: {PAIR_TOKENS} gradient rows",
        ]
        assert len(messages) == len(expected), (rank, messages)
        for message, want in zip(messages, expected):
            assert want in message, (rank, message, want)
