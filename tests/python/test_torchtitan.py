"""keel.integrations.torchtitan against torchtitan's own MoE layer, on 4 gloo ranks on the CPU.

The reference is torchtitan's ``MoE`` with its own expert parallelism: ``set_moe_sharding_config``
and ``MoE.parallelize`` over a ``ParallelDims`` of 4 EP ranks (the experts sharded 2 per rank as
DTensors, the ``AllToAllTokenDispatcher`` wired to the EP mesh). The same layer, from the same
weights, gets Keel inside (``use_keel``); both take 4 SGD steps on the same tokens, under the
static and the keel placement (replicas and transient replicas in use, an epoch committed), with
an expert bias that makes two experts hot. Before every step Keel's copies take torchtitan's
weights, so each step compares the two on the same weights and inputs: the outputs, the
gradients of the input, of the router and of the shared experts on every rank, and every
expert's gradient (torchtitan's EP shard against Keel's home after ``reduce_gradients``) agree
within TOLERANCE of the largest magnitude. Keel's slots compute with torchtitan's own
GroupedExperts (bfloat16 grouped GEMMs), so every expert row is the same to the bit; an expert
whose rows are split between copies gets a gradient that differs by bfloat16 rounding (each
copy's partial sum is rounded to bfloat16, as torchtitan rounds the whole sum, before the
float32 fold into the home). Under the static placement every gradient is bitwise torchtitan's.

Also: a torchtitan version outside the supported range is refused by name, with and without
torchtitan installed (this case runs without it too).

torchtitan 0.3.0 on torch 2.11 needs ``fill_torch_gaps`` (its EP dispatcher asks
``torch.compiler._is_non_strict_tracing``), the ``partial_dtensor`` backend (its default,
``spmd_types``, needs the trainer's SPMD mesh context) and a CPU device mesh (torchtitan picks
"cuda" when torch sees no accelerator, so the test sets ``parallel_dims.device_type``).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, List

import pytest

from integration_checks import assert_check_version, assert_versions_refused
from ranks import run_ranks, values
from test_training_loops import moe_config

RANKS = 4
EXPERTS = 8
TOP_K = 3
DIM = 32       # multiples of 8: bfloat16 grouped GEMMs want 16-byte strides
HIDDEN = 48
BATCH, SEQ = 2, 12
STEPS = 4
HOT = (1, 6)   # on ranks 0 and 3 under the static placement
# torchtitan's expert parameters -> Keel's (one expert's slice).
PARAMETERS = {"w1_EFD": "w1_FD", "w2_EDF": "w2_DF", "w3_EFD": "w3_FD"}
# Relative to the largest magnitude. Seen on 4 CPU ranks: outputs 7.1e-8 (the combine sums k in
# another order), input, router and shared-expert gradients 0, experts 5.7e-3 (bfloat16).
TOLERANCE = {"output": 1e-6, "input": 1e-6, "router": 1e-6, "shared": 1e-6, "experts": 1e-2}


def build_moe(expert_parallel: bool) -> Any:
    """torchtitan's MoE (softmax router top-3, routed and shared SwiGLU experts, expert bias),
    the same weights on every rank and in both builds."""
    import torch
    import spmd_types as spmd
    from torchtitan.models.common import config_utils
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    normal = {"weight": partial(torch.nn.init.normal_, std=0.1)}
    config = config_utils.make_moe_config(
        num_experts=EXPERTS,
        router=config_utils.make_router_config(dim=DIM, num_experts=EXPERTS,
                                               gate_param_init=normal, top_k=TOP_K,
                                               score_func="softmax"),
        routed_experts=config_utils.make_routed_experts_config(
            dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
            param_init={name: partial(torch.nn.init.normal_, std=0.1)
                        for name in ("w1_EFD", "w2_EDF", "w3_EFD")},
            comm_backend="standard"),
        shared_experts=config_utils.make_ffn_config(dim=DIM, hidden_dim=HIDDEN,
                                                    w1_param_init=normal,
                                                    w2w3_param_init=normal))
    if expert_parallel:
        set_moe_sharding_config(config, enable_ep=True, enable_sp=False,
                                expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2),
                                                     "w3_EFD": spmd.S(1)})
    torch.manual_seed(5)
    moe = config.build()
    moe.init_states()
    with torch.no_grad():  # two hot experts: replicas pay
        moe.expert_bias_E[list(HOT)] = 0.3
    return moe


def expert_parallel_dims(world: int) -> Any:
    """torchtitan's ParallelDims with every rank an EP rank, its meshes on the CPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils as dist_utils
    parallel_dims.device_type = "cpu"
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world,
                                      world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def step_batch(step: int, rank: int) -> Any:
    import torch
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)


def average_dense(params: List[Any], world: int) -> None:
    import torch.distributed as dist
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= world


def train_both(rank: int, world: int, policy: str) -> Dict[str, Any]:
    """torchtitan's EP layer and the layer with Keel, STEPS steps of SGD on the same batches:
    per step the largest relative difference of each compared quantity, this rank's expert
    gradients of both (expert -> name -> tensor), and whether copies beyond the homes ran."""
    import torch
    import keel.integrations.torchtitan as titan

    titan.fill_torch_gaps()
    reference = build_moe(expert_parallel=True)
    reference.parallelize(expert_parallel_dims(world))
    keel_moe = build_moe(expert_parallel=False)
    holder = torch.nn.Module()
    holder.moe = keel_moe
    moe = titan.use_keel(holder, config=moe_config(policy, world), optimizer="none",
                         average_gradients=False)
    per_rank = EXPERTS // world
    sgd = {name: torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
           for name, model in (("reference", reference), ("keel", holder))}
    titan.attach(moe, sgd["keel"])
    dense = {name: [p for n, p in model.named_parameters()
                    if n.startswith(("router.", "shared_experts.", "moe.router.",
                                     "moe.shared_experts."))]
             for name, model in (("reference", reference), ("keel", holder))}

    def relative(got: Any, want: Any) -> float:
        return float((got - want).abs().max()) / float(want.abs().max())

    differences, gradients, copies_ran = [], [], []
    for step in range(STEPS):
        x, probe = step_batch(step, rank)
        found = {}
        for name, layer in (("reference", reference), ("keel", keel_moe)):
            x_in = x.clone().requires_grad_(True)
            out = layer(x_in)
            (out * probe).sum().backward()
            found[name] = {"output": out.detach(), "input": x_in.grad,
                           "router": layer.router.gate.weight.grad.clone(),
                           "shared": torch.cat([p.grad.reshape(-1) for p in
                                                layer.shared_experts.parameters()])}
        moe.reduce_gradients()
        inner = reference.routed_experts.inner_experts
        theirs = {rank * per_rank + i: {ours: getattr(inner, name).grad.to_local()[i].clone()
                                        for name, ours in PARAMETERS.items()}
                  for i in range(per_rank)}
        dispatcher = keel_moe.routed_experts.dispatcher
        ours = {e: {n: p.grad.clone() for n, p in params.items()}
                for e, params in dispatcher.home_parameters().items()}
        gradients.append({"reference": theirs, "keel": ours})
        differences.append({key: relative(found["keel"][key], found["reference"][key])
                            for key in found["keel"]})
        route = dispatcher.last_route
        persistent = int(moe.engine.placement(0)["logcnt"].max()) > 1
        transient = any(int(e) >= 0 for e in route.local_experts[moe.engine.slots_per_rank:])
        copies_ran.append(persistent or transient)
        for name, optimizer in sgd.items():
            average_dense(dense[name], world)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # The next step compares on the same weights again: Keel's copies of every expert (and
        # the dense weights) take torchtitan's values, which differ by the bfloat16 rounding of
        # the expert gradients; the placement and its epochs stay Keel's.
        moe.load_state_dict({f"layers.0.experts.{e}.{ours}": full[e]
                             for theirs, ours in PARAMETERS.items()
                             for full in [getattr(inner, theirs).full_tensor().detach()]
                             for e in range(EXPERTS)})
        with torch.no_grad():
            for want, got in zip(dense["reference"], dense["keel"]):
                got.copy_(want)
    epochs = moe.stats()["epochs_committed"]
    moe.close()
    return {"differences": differences, "gradients": gradients, "copies_ran": copies_ran,
            "epochs": epochs}


def train_under_both(rank: int, world: int) -> Dict[str, Any]:
    return {policy: train_both(rank, world, policy) for policy in ("static", "keel")}


def test_keel_inside_torchtitans_moe_matches_its_expert_parallelism() -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/dev makes "
                                             ".venv-torchtitan with it)")
    by_rank = values(run_ranks(train_under_both, RANKS, timeout=280))
    for policy in ("static", "keel"):
        for rank, answer in enumerate(by_rank):
            for step, found in enumerate(answer[policy]["differences"]):
                for key, limit in TOLERANCE.items():
                    if key == "experts":
                        continue
                    assert found[key] <= limit, (policy, rank, step, key, found)
        for step in range(STEPS):
            theirs = {e: g for answer in by_rank
                      for e, g in answer[policy]["gradients"][step]["reference"].items()}
            ours = {e: g for answer in by_rank
                    for e, g in answer[policy]["gradients"][step]["keel"].items()}
            assert sorted(theirs) == sorted(ours) == list(range(EXPERTS)), (policy, step)
            for e in range(EXPERTS):
                for name, want in theirs[e].items():
                    got = ours[e][name]
                    worst = float((got - want).abs().max()) / float(want.abs().max())
                    assert worst <= TOLERANCE["experts"], (policy, step, e, name, worst)
    keel = [answer["keel"] for answer in by_rank]
    assert any(ran for answer in keel for ran in answer["copies_ran"]), (
        "the keel placement ran no replica or transient replica: the test compares nothing "
        "Keel adds")
    assert not any(ran for answer in by_rank for ran in answer["static"]["copies_ran"])


def checkpoints_both_ways(rank: int, world: int, folder: str) -> Dict[str, float]:
    """A Keel model trained 3 steps under the keel placement saves with DCP; torchtitan's layer
    without Keel, plain and with its EP, loads it. torchtitan's EP layer, trained 3 steps on its
    own, saves; a fresh Keel model loads it. Returns the largest differences of the weights and
    of the outputs on a batch."""
    import torch
    import torch.distributed.checkpoint as dcp
    import keel.integrations.torchtitan as titan

    titan.fill_torch_gaps()
    dims = expert_parallel_dims(world)

    def holding(moe: Any) -> Any:  # the layer as "moe" of a model: a model's keys
        holder = torch.nn.Module()
        holder.moe = moe
        return holder

    def keel_model() -> Any:
        holder = holding(build_moe(expert_parallel=False))
        return holder, titan.use_keel(holder, config=moe_config("keel", world),
                                      optimizer="none", average_gradients=False)

    def train(model: Any, steps: int) -> None:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        if isinstance(model.moe.routed_experts, titan.KeelRoutedExperts):
            titan.attach(model.moe.routed_experts.dispatcher._moe, sgd)
        dense = [p for n, p in model.named_parameters()
                 if n.startswith(("moe.router.", "moe.shared_experts."))]
        for step in range(steps):
            x, probe = step_batch(step, rank)
            (model.moe(x) * probe).sum().backward()
            average_dense(dense, world)  # the same dense weights on every rank
            sgd.step()
            sgd.zero_grad(set_to_none=True)

    def load(model: Any, path: str) -> Any:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        return model

    def whole(model: Any) -> Dict[str, Any]:
        """The layer's weights as whole tensors, torchtitan's keys (Keel's state dict has them)."""
        state = model.state_dict()
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}

    def differences(a: Any, b: Any) -> Dict[str, float]:
        x, _ = step_batch(9, rank)
        weights_a, weights_b = whole(a), whole(b)
        assert sorted(weights_a) == sorted(weights_b), (sorted(weights_a), sorted(weights_b))
        with torch.no_grad():
            out_a, out_b = a.moe(x), b.moe(x)
        return {"weights": max(float((weights_a[k] - weights_b[k]).abs().max())
                               for k in weights_a),
                "outputs": float((out_a - out_b).abs().max()) / float(out_b.abs().max())}

    found = {}
    # Saved with Keel (homes moved, replicas filled), loaded by torchtitan without Keel.
    with_keel, moe = keel_model()
    train(with_keel, 3)
    found["keel epochs"] = moe.stats()["epochs_committed"]
    dcp.save({"model": with_keel.state_dict()}, checkpoint_id=f"{folder}/keel")
    plain = load(holding(build_moe(expert_parallel=False)), f"{folder}/keel")
    reference = build_moe(expert_parallel=True)
    reference.parallelize(dims)
    expert_parallel = load(holding(reference), f"{folder}/keel")
    for name, other in (("plain", plain), ("ep", expert_parallel)):
        for key, value in differences(other, with_keel).items():
            found[f"keel -> {name} {key}"] = value
    moe.close()
    # Saved by torchtitan's EP layer, loaded with Keel.
    train(expert_parallel, 3)
    dcp.save({"model": expert_parallel.state_dict()}, checkpoint_id=f"{folder}/ep")
    fresh, moe = keel_model()
    load(fresh, f"{folder}/ep")
    for key, value in differences(fresh, expert_parallel).items():
        found[f"ep -> keel {key}"] = value
    # A checkpoint of another shape is refused naming the key; no slot changes.
    before = whole(fresh)
    state = dict(before)
    state["moe.routed_experts.inner_experts.w2_EDF"] = torch.zeros(EXPERTS, DIM, DIM)
    try:
        fresh.load_state_dict(state, strict=False)
        found["wrong shape refused"] = 0.0
    except RuntimeError as error:
        found["wrong shape refused"] = float(
            "moe.routed_experts.inner_experts.w2_EDF: shape [8, 32, 32]" in str(error))
    found["wrong shape weights"] = max(float((after - before[k]).abs().max())
                                       for k, after in whole(fresh).items())
    found["trained"] = max(float((a - b).abs().max()) for a, b in
                           zip(whole(expert_parallel).values(), whole(plain).values()))
    moe.close()
    return found


def test_checkpoints_load_both_ways_between_keel_and_torchtitan(tmp_path: Any) -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    for rank, found in enumerate(values(run_ranks(checkpoints_both_ways, RANKS, str(tmp_path),
                                                  timeout=280))):
        assert found["keel epochs"] >= 1, found
        assert found["trained"] > 1e-3, f"the EP layer's training changed nothing: {found}"
        assert found["wrong shape refused"] == 1.0, found
        for key, value in found.items():
            if key.endswith("weights"):
                assert value == 0.0, (rank, key, found)
            elif key.endswith("outputs"):
                assert value <= TOLERANCE["output"], (rank, key, found)


def test_an_unsupported_torchtitan_version_is_refused_by_name(monkeypatch: Any) -> None:
    assert_versions_refused(monkeypatch, "keel.integrations.torchtitan", "torchtitan",
                            (("0.2.2", "torchtitan 0.2.2 is installed"),
                             ("0.4.0.dev20261101", "torchtitan 0.4.0.dev20261101 is installed"),
                             ("", "needs torchtitan, which is not installed")),
                            ">= 0.3.0, < 0.4.0")
    assert_check_version("keel.integrations.torchtitan", "torchtitan", "torchtitan",
                         ("0.3.0", "0.3.7+local"), "0.2.9")


def test_use_keel_refuses_what_it_cannot_take_by_name() -> None:
    """Each refusal comes before any collective, naming the layer (one process, no group)."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    import torch
    import keel
    import keel.integrations.torchtitan as titan

    def refused(model: Any, *words: str) -> None:
        with pytest.raises(keel.InvalidArgumentError) as error:
            titan.use_keel(model)
        for word in words:
            assert word in str(error.value), str(error.value)

    refused(torch.nn.Linear(2, 2), "Linear", "holds no torchtitan MoE layer")

    def model_of(*layers: Any) -> Any:
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(layers)
        return model

    on_meta = build_moe(expert_parallel=False)
    on_meta.routed_experts.inner_experts.to("meta")
    refused(model_of(on_meta), "layers.0.routed_experts.inner_experts.w1_EFD",
            "meta device", "after the model's weights are initialized")
    expert_parallel = build_moe(expert_parallel=False)
    expert_parallel.routed_experts.token_dispatcher.ep_mesh = object()
    refused(model_of(expert_parallel), "layers.0 runs torchtitan's expert parallelism",
            "expert_parallel_degree = 1")
    other_top_k = build_moe(expert_parallel=False)
    other_top_k.router.top_k = TOP_K - 1
    refused(model_of(build_moe(expert_parallel=False), other_top_k),
            f"layers.1: GroupedExperts of shape [{EXPERTS}, {HIDDEN}, {DIM}], top-{TOP_K - 1}",
            "the same experts in every layer")
    replaced = build_moe(expert_parallel=False)
    replaced.routed_experts = torch.nn.Identity()
    refused(model_of(replaced), "layers.0.routed_experts is Identity",
            "without torchtitan's GroupedExperts")
