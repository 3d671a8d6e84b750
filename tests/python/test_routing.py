"""keel.torch's routing on the tensors' device (keel/torch/routing.py) against the rule it
implements: every entry's slot equals a plain reading of the quota table (the entries of expert
e fill its copies in order, each taking its quota, the last the rest), the dispatch order is by
destination bucket then entry; and on 4 real ranks under the keel policy (replicas, transient
slots) the slots equal those the engine's own C++ remap assigns from the same table."""

from __future__ import annotations

import random
from typing import Any, Dict, List

import numpy
import pytest
import torch

from ranks import DEVICES, run_ranks, values
from test_dispatcher import EXPERTS, RANKS, TOP_K, moe_config, skewed_batch


def reference_slots(ids: List[int], copy_begin: List[int], copy_slot: List[int],
                    copy_quota: List[int]) -> List[int]:
    """The quota rule read literally, one entry at a time."""
    slots, seen = [], {}
    for e in ids:
        if e < 0:
            slots.append(-1)
            continue
        rank = seen.get(e, 0)
        seen[e] = rank + 1
        copies = range(copy_begin[e], copy_begin[e + 1])
        chosen, filled = copies[-1], 0
        for c in copies:
            if rank < filled + copy_quota[c]:
                chosen = c
                break
            filled += copy_quota[c]
        slots.append(copy_slot[chosen])
    return slots


def random_table(rnd: random.Random, ids: List[int], experts: int, num_slots: int) -> Any:
    """A quota table of 1-3 copies per expert on distinct slots, with quotas that may fall
    short of (or exceed) the expert's entries."""
    copy_begin, quotas = [0], []
    for e in range(experts):
        for _ in range(rnd.randint(1, 3)):
            quotas.append(rnd.randint(0, ids.count(e)))
        copy_begin.append(len(quotas))
    copy_slot = rnd.sample(range(num_slots), len(quotas))
    return copy_begin, copy_slot, quotas


@pytest.mark.parametrize("device", DEVICES)
def test_slots_and_order_follow_the_quota_rule(device: str) -> None:
    from keel.torch.routing import count_experts, dispatch_order
    for trial in range(200):
        rnd = random.Random(trial)
        experts, tokens, top_k = rnd.randint(1, 9), rnd.randint(0, 40), rnd.randint(1, 3)
        ids = [rnd.choice([-1] + list(range(experts))) if rnd.random() < 0.1
               else rnd.randrange(experts) for _ in range(tokens * top_k)]
        num_slots = 3 * experts + rnd.randint(0, 4)
        copy_begin, copy_slot, quotas = random_table(rnd, ids, experts, num_slots)
        slot_key = numpy.array(rnd.sample(range(num_slots), num_slots), dtype=numpy.int64)
        ids_TK = torch.tensor(ids, dtype=torch.int64, device=device).view(tokens, top_k)

        count = count_experts(ids_TK, experts)
        dispatch = dispatch_order(count, copy_begin, copy_slot, quotas, slot_key, len(ids))

        assert count.counts_E.tolist() == [ids.count(e) for e in range(experts)]
        want = reference_slots(ids, copy_begin, copy_slot, quotas)
        assert dispatch.slot.tolist() == want, f"trial {trial}"
        sent = [i for i in range(len(ids)) if want[i] >= 0]
        order = sorted(sent, key=lambda i: (int(slot_key[want[i]]), i))
        assert dispatch.order.tolist() == order, f"trial {trial}"
        position = dispatch.position.tolist()
        assert [position[i] for i in order] == list(range(len(order)))
        assert all(position[i] == len(order) for i in range(len(ids)) if want[i] < 0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_expert_id_is_named_before_any_narrowing(device: str) -> None:
    import keel
    from keel.torch.routing import count_experts
    ids = torch.tensor([[0, 1], [2, 2 ** 32]], device=device)
    with pytest.raises(keel.InvalidArgumentError,
                       match=r"topk_ids\[3\] = 4294967296 is not an expert id in \[0, 4\)"):
        count_experts(ids, 4)
    with pytest.raises(keel.InvalidArgumentError, match=r"topk_ids\[1\] = -2 is not"):
        count_experts(torch.tensor([[3, -2]], device=device), 4)


def engine_against_routing(rank: int, world: int, steps: int) -> Dict[str, Any]:
    """Routes skewed batches with Engine.route (the C++ remap) and reassigns the same entries
    from the route's quota table with keel.torch's routing; returns the mismatches and what the
    placement used."""
    import keel.torch as kt
    from keel.torch.routing import count_experts, dispatch_order

    moe = kt.KeelMoE(kt.ffn_expert(16, 24), num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                     config=moe_config("keel"))
    engine = moe.engine
    mismatches, transients, replicas = 0, 0, 0
    for step in range(steps):
        _, ids, _ = skewed_batch(step, rank)
        route = engine.route(0, ids)
        count = count_experts(ids, EXPERTS)
        dispatch = dispatch_order(count, route.copy_begin, route.copy_slot, route.copy_quota,
                                  moe.slot_keys, ids.numel())
        mismatches += int((dispatch.slot.view(ids.shape) != route.slot).sum())
        destination = torch.tensor([engine.locate_slot(int(s))[0] if s >= 0 else world
                                    for s in route.slot.reshape(-1)])
        sent = torch.bincount(destination, minlength=world + 1)[:world]
        mismatches += int((sent != route.send_counts).sum())
        transients += int(route.recv_counts[:, engine.slots_per_rank:].sum())
        replicas += int((engine.placement(0)["logcnt"] > 1).sum())
        engine.reduce_gradients()
        engine.step_end()
    moe.close()
    return {"mismatches": mismatches, "transients": transients, "replicas": replicas}


def test_slots_equal_the_engines_remap() -> None:
    results = values(run_ranks(engine_against_routing, RANKS, 10))
    assert sum(r["mismatches"] for r in results) == 0, results
    assert sum(r["replicas"] for r in results) > 0, "no replica: the test proves little"
    assert sum(r["transients"] for r in results) > 0, "no transient slot took entries"
