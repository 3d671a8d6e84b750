"""Parm's de-duplicated dispatch in the keel package on 4 real ranks: with
``Engine(mp_group_size=2)`` every member of a pair passes the pair's tokens, routes only its half
(``Route.share_begin``, ``share_end``; the other half's slots are -1) and gets exactly the slots
and splits it gets when it passes its own tokens alone; a group size that does not divide the
node's ranks is an error naming it."""

from __future__ import annotations

from typing import Any, Dict

from ranks import run_ranks, static_config, values

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
