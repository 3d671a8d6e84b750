"""keel.integrations.megatron against Megatron-Core's own MoELayer, on 2 gloo ranks on the CPU.

The reference is Megatron-Core 0.16.1's ``MoELayer`` with its ``alltoall`` token dispatcher,
expert parallelism over the 2 ranks (2 of the 4 experts per rank), a ``TopKRouter`` with its
auxiliary loss and ``SequentialMLP`` experts of the local layer spec (``linear_fc1``, GELU,
``linear_fc2``). Megatron writes CUDA into a few of these calls; megatron_on_cpu.py answers them
for the CPU without changing Megatron's arithmetic. The same layer, from the same weights, gets
Keel inside (``use_keel``); both take 3 SGD steps on the same tokens in the CASES below: the
static and the keel placement (replicas and transient replicas in use, an epoch committed),
dropless and with a capacity (the router drops choices over capacity; with
``moe_pad_expert_input_to_capacity`` Megatron fills each expert's capacity with zero-weight
rows, which Keel leaves out). Before every step Keel's copies and router take Megatron's
weights, so each step compares the two on the same weights and inputs: the outputs, the
gradients of the input and of the router on every rank, and every expert's gradient (Megatron's
on its expert-parallel rank against Keel's home after ``reduce_gradients``) agree within
TOLERANCE of the largest magnitude.

The same ranks check the parameter bookkeeping: Keel's slots are not among the model's
parameters, Megatron's optimizer groups (``_get_param_groups``, what ``get_megatron_optimizer``
builds from) and its DistributedDataParallel's buffers leave them out and do not move them, and
3 steps through that DDP with Keel's own AdamW and ``attach`` give every home a gradient and
leave every copy equal to its home after the step (replicas in use). And each refusal of
``use_keel``, by name.

Also, in one process: the conversion of probs and routing_map to top-k ids and weights (from
Megatron's own top-k routing and token dropping, ties, rows without a choice, capacity padding)
and back, and the version pin.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from integration_checks import (assert_check_version, assert_layers_agree,
                                assert_versions_refused, copies_ran, expert_gradients, relative)
from ranks import run_ranks, values

RANKS = 2
EXPERTS = 4
TOP_K = 2
HIDDEN = 16
FFN = 24
SEQ, BATCH = 8, 2          # 16 tokens per rank
STEPS = 3
HOT = (0, 1)               # both on rank 0 under the static placement
# (placement, capacity factor or None, pad to capacity)
CASES = [("keel", None, False), ("keel", 1.0, True), ("static", None, False),
         ("static", 1.0, False)]
# Relative to the largest magnitude. Seen on the CPU: outputs 2.3e-7, input gradients 4.6e-7,
# router gradients 4.3e-7, expert gradients 2.6e-7 (float32 sums in another order: Megatron
# scales the activation by the weight before linear_fc2, Keel the expert's output; Keel adds a
# hot expert's copies into its home).
TOLERANCE = {"output": 2e-6, "input": 2e-6, "router": 2e-6, "experts": 2e-6}


def keel_config(policy: str) -> Dict[str, Any]:
    return {
        "topology": {"num_nodes": 1, "gpus_per_node": RANKS},
        "slots": {"persistent_per_rank": EXPERTS // RANKS + 1, "transient_per_rank": 1},
        "cost_model": {"hidden_size": HIDDEN, "expert_ffn_size": FFN, "expert_tflops": 1e-6,
                       "dtype_bytes": 4},
        "policy": {"name": policy, "replan_interval_steps": 1, "plan_adoption": "next_step"},
        "migration": {"transport": "ucx", "deadline_seconds": 20},
        "engine": {"collective_timeout_seconds": 60},
    }


def start_megatron(world: int, device: str) -> None:
    """Megatron's parallel state over the ranks' gloo group: expert parallelism over all of them.
    On the CPU with megatron_on_cpu.py's answers to its CUDA calls; on a GPU as it is (but for
    the name that megatron-core 0.16.1 leaves undefined without Transformer Engine)."""
    import torch
    from megatron_on_cpu import answer_cuda_calls_on_the_cpu, define_missing_te_general_gemm
    if device == "cpu":
        answer_cuda_calls_on_the_cpu()
    else:
        define_missing_te_general_gemm()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world,
                                             create_gloo_process_groups=False)
    torch.manual_seed(0)


def build_layer(rank: int, capacity: Any, pad: bool, device: str) -> Any:
    """Megatron's MoELayer (alltoall dispatcher) with this rank's experts and a router that
    prefers the HOT experts (the inputs lean along dimension 0)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
        use_cpu_initialization=device == "cpu", perform_initialization=False,
        moe_token_dispatcher_type="alltoall", add_bias_linear=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
        expert_model_parallel_size=RANKS, params_dtype=torch.float32,
        moe_expert_capacity_factor=capacity, moe_pad_expert_input_to_capacity=pad)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    layer = MoELayer(config, spec.submodules.mlp.submodules).to(device)
    per_rank = EXPERTS // RANKS
    with torch.no_grad():
        for local, expert in enumerate(layer.experts.local_experts):
            for name, value in expert_values(rank * per_rank + local).items():
                expert.get_parameter(name).copy_(value)
        weight = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(7)) * 0.3
        weight[list(HOT), 0] = 1.5
        layer.router.weight.copy_(weight)
    return layer


def expert_values(expert: int) -> Dict[str, Any]:
    import torch
    g = torch.Generator().manual_seed(50 + expert)
    return {"linear_fc1.weight": torch.randn(FFN, HIDDEN, generator=g) * 0.3,
            "linear_fc2.weight": torch.randn(HIDDEN, FFN, generator=g) * 0.3}


def step_batch(step: int, rank: int, device: str) -> Any:
    import torch
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    x[..., 0] += 1.5
    return x.to(device), torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(device)


def all_experts(layer: Any, world: int) -> Dict[int, Dict[str, Any]]:
    """Megatron's experts (Keel's parameter names), every rank's, on every rank."""
    import torch.distributed as dist
    per_rank = EXPERTS // world
    mine = {dist.get_rank() * per_rank + local: {n.replace(".", "_"): p.detach().clone()
                                                 for n, p in expert.named_parameters()}
            for local, expert in enumerate(layer.experts.local_experts)}
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {e: params for part in everyone for e, params in part.items()}


def compare_layers(rank: int, world: int, device: str, policy: str, capacity: Any,
                   pad: bool) -> Dict[str, Any]:
    import torch
    import keel.integrations.megatron as keel_megatron

    reference = build_layer(rank, capacity, pad, device)
    layer = build_layer(rank, capacity, pad, device)
    moe = keel_megatron.use_keel(layer, config=keel_config(policy), optimizer="none",
                                 average_gradients=False)
    dense = {"reference": torch.optim.SGD(reference.parameters(), lr=0.1),
             "keel": torch.optim.SGD(layer.parameters(), lr=0.1)}
    experts_sgd = torch.optim.SGD(moe.parameters(), lr=0.1)
    moe.attach(experts_sgd)
    dispatcher = layer.token_dispatcher.dispatcher
    differences, gradients, dropped, ran = [], [], [], []
    for step in range(STEPS):
        x, probe = step_batch(step, rank, device)
        found = {}
        for name, module in (("reference", reference), ("keel", layer)):
            x_in = x.clone().requires_grad_(True)
            out, bias = module(x_in)
            assert bias is None
            (out * probe).sum().backward()
            found[name] = {"output": out.detach(), "input": x_in.grad,
                           "router": module.router.weight.grad.clone()}
        with torch.no_grad():
            probs, routing_map = reference.router(x)
        dropped.append(TOP_K * SEQ * BATCH - int(((probs != 0) & routing_map).sum()))
        moe.reduce_gradients()
        gradients.append(expert_gradients(rank, reference.experts.local_experts, dispatcher))
        differences.append({key: relative(found["keel"][key], found["reference"][key])
                            for key in ("output", "input", "router")})
        ran.append(copies_ran(moe, dispatcher))
        for optimizer in (*dense.values(), experts_sgd):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        moe.load_state_dict({f"layers.0.experts.{e}.{n}": value
                             for e, params in all_experts(reference, world).items()
                             for n, value in params.items()})
        with torch.no_grad():
            layer.router.weight.copy_(reference.router.weight)
    epochs = moe.stats()["epochs_committed"]
    moe.close()
    return {"differences": differences, "gradients": gradients, "dropped": dropped,
            "copies_ran": ran, "epochs": epochs}


def bookkeeping(rank: int, world: int, device: str) -> Dict[str, Any]:
    """Where Keel's slots are and are not: the model's parameters, Megatron's optimizer groups,
    its DistributedDataParallel's buffers; and that attach folds replicas into homes."""
    import torch
    import keel.integrations.megatron as keel_megatron
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    layer = build_layer(rank, None, False, device)
    moe = keel_megatron.use_keel(layer, config=keel_config("keel"), optimizer="adam")
    slots = {id(p) for p in moe.parameters()}
    addresses = {id(p): p.data_ptr() for p in moe.parameters()}
    found: Dict[str, Any] = {"model": sorted(n for n, _ in layer.named_parameters())}
    found["model_has_slots"] = any(id(p) in slots for p in layer.parameters())
    groups = _get_param_groups([layer], OptimizerConfig(lr=0.1), None)
    found["groups_have_slots"] = any(id(p) in slots for g in groups for p in g["params"])
    found["groups"] = sorted(n for g in groups for n, p in layer.named_parameters()
                             if any(p is q for q in g["params"]))
    ddp = DistributedDataParallel(layer.config, DistributedDataParallelConfig(), layer)
    bucketed = [p for buffer in ddp.buffers + ddp.expert_parallel_buffers
                for p in buffer.params]
    found["ddp_has_slots"] = any(id(p) in slots for p in bucketed)
    found["ddp_params"] = len(bucketed)
    found["slots_moved"] = any(p.data_ptr() != addresses[id(p)] for p in moe.parameters())
    optimizer = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    moe.attach(optimizer)
    dispatcher = layer.token_dispatcher.dispatcher
    engine = moe.engine
    first = engine.rank * engine.slots_per_rank
    found["copies_unlike_home"] = found["homes_without_gradient"] = 0
    found["copies_ran"] = []
    for step in range(STEPS):
        x, probe = step_batch(step, rank, device)
        out, _ = ddp(x)
        (out * probe).sum().backward()
        found["copies_ran"].append(copies_ran(moe, dispatcher))
        moe.reduce_gradients()
        found["homes_without_gradient"] += sum(
            p.grad is None for params in dispatcher.home_parameters().values()
            for p in params.values())
        optimizer.step()  # Keel's hooks: the replicas folded before, refreshed after
        optimizer.zero_grad(set_to_none=True)
        # Every persistent copy equals its expert's home.
        experts = moe.gather_experts(0)
        phy2log = engine.placement(0)["phy2log"]
        for local in range(engine.slots_per_rank):
            expert = int(phy2log[first + local])
            if expert >= 0:
                for name, param in dispatcher.slots[local].items():
                    found["copies_unlike_home"] += int(
                        not torch.equal(param.detach(), experts[expert][name]))
    found["slots_moved_after"] = any(p.data_ptr() != addresses[id(p)] for p in moe.parameters())
    found["epochs"] = moe.stats()["epochs_committed"]
    moe.close()
    return found


def refusals(rank: int, world: int, device: str) -> List[str]:
    """Each refusal of use_keel, before any collective, naming the layer."""
    import torch
    import keel
    import keel.integrations.megatron as keel_megatron
    from ranks import expect_error
    messages: List[str] = []
    expect_error(messages, keel.InvalidArgumentError,
                 lambda: keel_megatron.use_keel(torch.nn.Linear(2, 2)))
    replaced = build_layer(rank, None, False, device)
    replaced.experts = keel_megatron.KeelExperts()
    expect_error(messages, keel.InvalidArgumentError, lambda: keel_megatron.use_keel(replaced))
    on_meta = build_layer(rank, None, False, device)
    on_meta.experts.to("meta")
    expect_error(messages, keel.InvalidArgumentError, lambda: keel_megatron.use_keel(on_meta))
    overlap = build_layer(rank, None, False, device)
    overlap.config.moe_shared_expert_overlap = True
    expect_error(messages, keel.UnimplementedError, lambda: keel_megatron.use_keel(overlap))
    return messages


REFUSALS = [["Linear", "holds no Megatron MoELayer"],
            ["already has Keel's dispatcher and experts"],
            ["experts has parameters on the meta device", "after the model's weights"],
            ["moe_shared_expert_overlap", "turn it off"]]


def run_all(rank: int, world: int, device: str = "cpu") -> Dict[str, Any]:
    """Every case and the bookkeeping on one rank (bench/gpu/megatron_check.py runs it with
    CUDA tensors)."""
    start_megatron(world, device)
    answer: Dict[str, Any] = {case: compare_layers(rank, world, device, *case)
                              for case in CASES}
    answer["bookkeeping"] = bookkeeping(rank, world, device)
    answer["refusals"] = refusals(rank, world, device)
    return answer


def check_answers(by_rank: List[Dict[str, Any]]) -> Dict[str, float]:
    """Asserts what every rank found; returns the largest difference of each quantity."""
    worst = assert_layers_agree(by_rank, CASES, STEPS, EXPERTS, TOLERANCE)
    for case in CASES:
        _, capacity, _ = case
        dropped = sum(sum(answer[case]["dropped"]) for answer in by_rank)
        assert (dropped > 0) == (capacity is not None), (case, dropped)
    for rank, answer in enumerate(by_rank):
        found = answer["bookkeeping"]
        assert found["model"] == ["router.weight"], found["model"]
        assert not found["model_has_slots"], rank
        assert found["groups"] == ["router.weight"] and not found["groups_have_slots"], found
        assert found["ddp_params"] == 1 and not found["ddp_has_slots"], found
        assert not found["slots_moved"], rank
        assert found["homes_without_gradient"] == 0, found
        assert found["copies_unlike_home"] == 0, found
        assert not found["slots_moved_after"], found
    assert any(r for answer in by_rank for r in answer["bookkeeping"]["copies_ran"])
    for answer in by_rank:
        assert len(answer["refusals"]) == len(REFUSALS), answer["refusals"]
        for message, words in zip(answer["refusals"], REFUSALS):
            for word in words:
                assert word in message, (word, message)
    return worst


def test_keel_inside_megatrons_moe_layer_matches_its_alltoall_dispatcher() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                                                "(scripts/requirements-dev.txt pins it)")
    worst = check_answers(values(run_ranks(run_all, RANKS, timeout=240)))
    print("largest differences:", worst)


def test_routing_map_and_probs_become_topk_ids_and_weights() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import torch
    from megatron_on_cpu import define_missing_te_general_gemm
    define_missing_te_general_gemm()
    import keel
    from keel.integrations.megatron import routing_to_topk, topk_to_routing
    from megatron.core.transformer.moe.moe_utils import (apply_router_token_dropping,
                                                         topk_routing_with_score_function)

    # Megatron's own top-k routing: each row's choices in ascending expert order, weights its
    # probs; back again exactly.
    logits = torch.randn(12, 6, generator=torch.Generator().manual_seed(3), requires_grad=True)
    probs, routing_map = topk_routing_with_score_function(logits, 2, score_function="softmax")
    ids, weights = routing_to_topk(probs, routing_map, 2)
    assert ids.dtype == torch.int64 and ids.shape == (12, 2)
    assert bool((ids[:, 0] < ids[:, 1]).all())
    assert torch.equal(weights, probs.gather(1, ids))
    back_probs, back_map = topk_to_routing(ids, weights, 6)
    assert torch.equal(back_map, routing_map) and torch.equal(back_probs, probs)
    # Gradients flow back into probs at the chosen places only.
    weights.sum().backward()
    assert logits.grad is not None

    # Ties: equal weights keep ascending expert order.
    tied = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]])
    tied_map = tied > 0
    ids, weights = routing_to_topk(tied, tied_map, 4)
    assert ids.tolist() == [[1, 3, -1, -1], [0, 1, 2, 3]]
    assert weights.tolist() == [[0.5, 0.5, 0.0, 0.0], [0.25] * 4]

    # A row without a choice (a token dropped over capacity, or padding): all -1, weight 0.
    empty = torch.zeros(2, 4)
    ids, weights = routing_to_topk(empty, empty > 0, 2)
    assert ids.tolist() == [[-1, -1], [-1, -1]] and weights.abs().sum() == 0

    # Megatron's token dropping: dropped choices leave the map; with pad_to_capacity the map
    # gains zero-weight entries to fill each expert's capacity, which are not choices.
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    logits[:, 1] += 3.0  # expert 1 is hot: over capacity
    probs, routing_map = topk_routing_with_score_function(logits, 2, score_function="softmax")
    for pad in (False, True):
        dropped_probs, dropped_map = apply_router_token_dropping(
            probs, routing_map, router_topk=2, capacity_factor=1.0, pad_to_capacity=pad)
        ids, weights = routing_to_topk(dropped_probs, dropped_map, 2)
        kept = (dropped_probs != 0) & dropped_map
        assert int((ids >= 0).sum()) == int(kept.sum()) < 32, pad
        if pad:
            assert int(dropped_map.sum()) > int(kept.sum())  # padding entries exist
        want_probs, want_map = topk_to_routing(ids, weights, 4)
        assert torch.equal(want_map, kept) and torch.equal(want_probs, dropped_probs * kept)

    # More choices than top_k, or a malformed map, is refused by name.
    with pytest.raises(keel.InvalidArgumentError, match="token 1 of 2 has 3 experts"):
        routing_to_topk(torch.tensor([[0.5, 0.5, 0, 0], [0.2, 0.3, 0.5, 0]]),
                        torch.tensor([[True, True, False, False], [True, True, True, False]]),
                        2)
    with pytest.raises(keel.InvalidArgumentError, match="not torch.bool"):
        routing_to_topk(torch.zeros(2, 4), torch.zeros(2, 4), 2)
    with pytest.raises(keel.InvalidArgumentError, match="twice"):
        topk_to_routing(torch.tensor([[1, 1]]), torch.ones(1, 2), 4)


def test_an_unsupported_megatron_core_version_is_refused_by_name(monkeypatch: Any) -> None:
    assert_versions_refused(monkeypatch, "keel.integrations.megatron", "megatron-core",
                            (("0.15.3", "megatron-core 0.15.3 is installed"),
                             ("0.16.0", "megatron-core 0.16.0 is installed"),
                             ("0.17.0rc0", "megatron-core 0.17.0rc0 is installed"),
                             ("", "needs megatron-core, which is not installed")),
                            ">= 0.16.1, < 0.17.0")
    assert_check_version("keel.integrations.megatron", "megatron.core", "megatron-core",
                         ("0.16.1", "0.16.4+cu130"), "0.17.0")
