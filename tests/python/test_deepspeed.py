"""keel.integrations.deepspeed against DeepSpeed's own MoE layer, on 4 gloo ranks on the CPU.

The reference is DeepSpeed's ``MoE`` (``deepspeed.moe.layer``) with expert parallelism over the 4
ranks (``ep_size`` 4: 2 of the 8 experts per rank, MOELayer's two all-to-alls over its
expert-parallel group), a ``TopKGate`` and an expert of two ``Linear`` layers around a GELU. The
same layer, from the same weights, gets Keel inside (``use_keel``); both take 3 SGD steps on the
same tokens, in the CASES below: the static and the keel placement (replicas and transient
replicas in use, an epoch committed), with and without ``drop_tokens`` (capacity factor 1: two
hot experts lose most of their choices, and under the static placement some ranks' experts get
no rows at all), with each of DeepSpeed's gatings (top-1, top-2, top-k). The gate draws random
numbers (top-1's random token selection, top-2's sampled second expert), so each forward starts
from the same seed on both sides. Before every step Keel's
copies and gate take DeepSpeed's weights, so each step compares the two on the same weights and
inputs: the outputs, the gradients of the input and of the gate on every rank, and every
expert's gradient (DeepSpeed's on its expert-parallel rank against Keel's home after
``reduce_gradients``) agree within TOLERANCE of the largest magnitude.

A second test trains a small model through DeepSpeed's engine (``deepspeed.initialize`` with a
torch SGD, ZeRO off) with DeepSpeed's layer and with Keel's (keel placement, drop_tokens on), 3
steps: the losses, the gate and every expert's final weights agree within TOLERANCE.

Also: a deepspeed version outside the supported range is refused by name (with and without
deepspeed installed), and use_keel refuses what it cannot take, by name.

DeepSpeed on a CPU-only machine picks its CPU accelerator (gloo). Its communication layer would
compile a C++ shared-memory all-reduce the first time it starts (deepspeed_shm_comm, about 90 s
of one core); these tests mark that op unavailable, and DeepSpeed then uses torch.distributed's
gloo group as it is.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest

from integration_checks import (assert_check_version, assert_layers_agree,
                                assert_versions_refused, copies_ran, expert_gradients, relative)
from ranks import run_ranks, values
from test_training_loops import moe_config

RANKS = 4
EXPERTS = 8
TOP_K = 2
DIM = 16
HIDDEN = 24
BATCH, SEQ = 2, 12      # 24 tokens per rank: capacity 6 per expert with drop_tokens
STEPS = 3
HOT = (1, 6)            # on ranks 0 and 3 under the static placement
# (placement, drop_tokens, k): DeepSpeed's three gatings (top-1 with random token selection,
# top-2 with a sampled second expert, top-k), each with a capacity that drops and without.
CASES = [("keel", True, 2), ("keel", False, 2), ("keel", True, 3), ("static", True, 1),
         ("static", False, 1), ("static", False, 3)]
# Relative to the largest magnitude. Seen on the CPU: outputs 1.1e-7, input gradients 1.6e-7,
# gate gradients 1.8e-7, expert gradients 3.4e-7 (float32 sums in another order: DeepSpeed's
# experts multiply capacity buffers, Keel's their rows), the engine's losses and weights 7.2e-8.
TOLERANCE = {"output": 1e-6, "input": 1e-6, "gate": 1e-6, "experts": 2e-6, "engine": 1e-6}


def start_deepspeed(rank: int, world: int) -> None:
    """DeepSpeed's communication over the ranks' gloo group (already initialized), without
    compiling its shared-memory op; the environment its engine asks for."""
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world)})
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


def expert_values(expert: int) -> Dict[str, Any]:
    """Expert ``expert``'s weights (DeepSpeed's parameter names), the same on every rank."""
    import torch
    g = torch.Generator().manual_seed(50 + expert)
    return {"0.weight": torch.randn(HIDDEN, DIM, generator=g) * 0.3,
            "0.bias": torch.randn(HIDDEN, generator=g) * 0.1,
            "2.weight": torch.randn(DIM, HIDDEN, generator=g) * 0.3,
            "2.bias": torch.randn(DIM, generator=g) * 0.1}


def build_moe(rank: int, world: int, drop_tokens: bool, k: int = TOP_K,
              groups: bool = True) -> Any:
    """DeepSpeed's MoE over ``world`` ranks with a top-``k`` gate, experts from
    :func:`expert_values`, a gate that prefers the HOT experts (the inputs lean along dimension
    0); with ``groups``, its expert-parallel group set as DeepSpeed's engine sets it (else the
    engine does)."""
    import torch
    from deepspeed.moe.layer import MoE
    expert = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(),
                                 torch.nn.Linear(HIDDEN, DIM))
    moe = MoE(DIM, expert, num_experts=EXPERTS, ep_size=world, k=k, capacity_factor=1.0,
              min_capacity=0, drop_tokens=drop_tokens)
    per_rank = EXPERTS // world
    with torch.no_grad():
        for local, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            for name, value in expert_values(rank * per_rank + local).items():
                module.get_parameter(name).copy_(value)
        wg = moe.deepspeed_moe.gate.wg.weight
        wg.copy_(torch.randn(EXPERTS, DIM, generator=torch.Generator().manual_seed(7)) * 0.3)
        wg[list(HOT), 0] = 1.5
    if groups:
        moe.set_deepspeed_parallelism()
    return moe


def step_batch(step: int, rank: int) -> Any:
    import torch
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(BATCH, SEQ, DIM, generator=g)
    x[..., 0] += 1.5
    return x, torch.randn(BATCH, SEQ, DIM, generator=g)


def all_experts(moe: Any, world: int) -> Dict[int, Dict[str, Any]]:
    """DeepSpeed's layer's experts (Keel's parameter names), every rank's, on every rank."""
    import torch.distributed as dist
    per_rank = EXPERTS // world
    mine = {dist.get_rank() * per_rank + local: {n.replace(".", "_"): p.detach().clone()
                                                 for n, p in module.named_parameters()}
            for local, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts)}
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {e: params for part in everyone for e, params in part.items()}


def compare_layers(rank: int, world: int, policy: str, drop_tokens: bool,
                   k: int) -> Dict[str, Any]:
    """DeepSpeed's layer and the layer with Keel, STEPS steps of SGD on the same batches: per
    step the largest relative difference of each compared quantity, this rank's expert
    gradients of both (expert -> name -> tensor), the choices the gate dropped, and whether
    copies beyond the homes ran."""
    import torch
    import keel.integrations.deepspeed as keel_ds

    reference = build_moe(rank, world, drop_tokens, k)
    keel_layer = build_moe(rank, world, drop_tokens, k)
    moe = keel_ds.use_keel(keel_layer, config=moe_config(policy, world), optimizer="none")
    sgd = {"reference": torch.optim.SGD(reference.parameters(), lr=0.1),
           "keel": torch.optim.SGD(keel_layer.parameters(), lr=0.1)}
    moe.attach(sgd["keel"])
    dispatcher = keel_layer.deepspeed_moe.dispatcher
    differences, gradients, dropped, ran = [], [], [], []
    for step in range(STEPS):
        x, probe = step_batch(step, rank)
        found = {}
        for name, layer in (("reference", reference), ("keel", keel_layer)):
            x_in = x.clone().requires_grad_(True)
            torch.manual_seed(1000 * step + rank)  # the gate's random numbers
            out, l_aux, counts = layer(x_in)
            (out * probe).sum().backward()
            found[name] = {"output": out.detach(), "input": x_in.grad,
                           "gate": layer.deepspeed_moe.gate.wg.weight.grad.clone(),
                           "l_aux": l_aux.detach(), "counts": counts}
        assert torch.equal(found["keel"]["l_aux"], found["reference"]["l_aux"])
        assert torch.equal(found["keel"]["counts"], found["reference"]["counts"])
        torch.manual_seed(1000 * step + rank)
        routes = reference.deepspeed_moe.gate(x.reshape(-1, DIM), None, True)[3]
        dropped.append(int((routes < 0).sum()))
        moe.reduce_gradients()
        gradients.append(expert_gradients(
            rank, reference.deepspeed_moe.experts.deepspeed_experts, dispatcher))
        differences.append({key: relative(found["keel"][key], found["reference"][key])
                            for key in ("output", "input", "gate")})
        ran.append(copies_ran(moe, dispatcher))
        for optimizer in sgd.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # The next step compares on the same weights again: Keel's copies of every expert and
        # its gate take DeepSpeed's values; the placement and its epochs stay Keel's.
        moe.load_state_dict({f"layers.0.experts.{e}.{n}": value
                             for e, params in all_experts(reference, world).items()
                             for n, value in params.items()})
        with torch.no_grad():
            keel_layer.deepspeed_moe.gate.wg.weight.copy_(reference.deepspeed_moe.gate.wg.weight)
    epochs = moe.stats()["epochs_committed"]
    moe.close()
    return {"differences": differences, "gradients": gradients, "dropped": dropped,
            "copies_ran": ran, "epochs": epochs}


def compare_all(rank: int, world: int) -> Dict[Any, Any]:
    start_deepspeed(rank, world)
    return {case: compare_layers(rank, world, *case) for case in CASES}


def test_keel_inside_deepspeeds_moe_layer_matches_its_expert_parallelism() -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed "
                                            "(scripts/requirements-dev.txt pins it)")
    by_rank = values(run_ranks(compare_all, RANKS, timeout=280))
    worst = assert_layers_agree(by_rank, list(by_rank[0]), STEPS, EXPERTS, TOLERANCE)
    for case in by_rank[0]:
        dropped = sum(sum(answer[case]["dropped"]) for answer in by_rank)
        _, drop_tokens, _ = case
        assert (dropped > 0) == drop_tokens, (case, dropped)
    print("largest differences:", worst)


def train_in_engine(rank: int, world: int) -> Dict[str, Any]:
    """A small model (a Linear, DeepSpeed's MoE, a Linear) trained 3 steps through
    ``deepspeed.initialize`` with DeepSpeed's layer and with Keel's: the losses, the gate's and
    every expert's weights after training."""
    import torch
    import deepspeed
    import keel.integrations.deepspeed as keel_ds
    start_deepspeed(rank, world)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(3)
            self.inp = torch.nn.Linear(DIM, DIM)
            self.moe = build_moe(rank, world, drop_tokens=True, groups=False)
            self.out = torch.nn.Linear(DIM, DIM)

        def forward(self, x: Any) -> Any:
            h, l_aux, _ = self.moe(self.inp(x))
            return (self.out(h) ** 2).mean() + 0.01 * l_aux

    found: Dict[str, Any] = {}
    for name in ("reference", "keel"):
        model = Model()
        moe = (keel_ds.use_keel(model, config=moe_config("keel", world), optimizer="none")
               if name == "keel" else None)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        if moe is not None:
            moe.attach(sgd)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=sgd,
            config={"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                    "train_batch_size": BATCH * world})
        losses = []
        for step in range(STEPS):
            x, _ = step_batch(step, rank)
            torch.manual_seed(1000 * step + rank)
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        experts = (all_experts(model.moe, world) if moe is None else
                   {e: {n: t.clone() for n, t in params.items()}
                    for e, params in enumerate(moe.gather_experts(0))})
        found[name] = {"losses": losses, "experts": experts,
                       "gate": model.moe.deepspeed_moe.gate.wg.weight.detach().clone()}
        if moe is not None:
            found["epochs"] = moe.stats()["epochs_committed"]
            moe.close()
    return found


def test_keel_trains_inside_deepspeeds_engine_as_its_own_layer_does() -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    worst = 0.0
    for rank, found in enumerate(values(run_ranks(train_in_engine, 2, timeout=200))):
        ours, theirs = found["keel"], found["reference"]
        for step, (got, want) in enumerate(zip(ours["losses"], theirs["losses"])):
            worst = max(worst, abs(got - want) / abs(want))
            assert abs(got - want) <= TOLERANCE["engine"] * abs(want), (rank, step, got, want)
        worst = max(worst, relative(ours["gate"], theirs["gate"]))
        assert relative(ours["gate"], theirs["gate"]) <= TOLERANCE["engine"], rank
        for e, params in theirs["experts"].items():
            for name, want in params.items():
                value = relative(ours["experts"][e][name], want)
                worst = max(worst, value)
                assert value <= TOLERANCE["engine"], (rank, e, name, value)
        assert found["epochs"] >= 1, found["epochs"]
    print("largest difference in the engine:", worst)


def test_an_unsupported_deepspeed_version_is_refused_by_name(monkeypatch: Any) -> None:
    assert_versions_refused(monkeypatch, "keel.integrations.deepspeed", "deepspeed",
                            (("0.18.4", "deepspeed 0.18.4 is installed"),
                             ("0.19.7", "deepspeed 0.19.7 is installed"),
                             ("0.20.0rc1", "deepspeed 0.20.0rc1 is installed"),
                             ("", "needs deepspeed, which is not installed")),
                            ">= 0.19.8, < 0.20.0")
    assert_check_version("keel.integrations.deepspeed", "deepspeed", "deepspeed",
                         ("0.19.8", "0.19.12+cpu"), "0.21.0")


def refusals(rank: int, world: int) -> List[str]:
    """Each refusal of use_keel, before any collective, naming the layer."""
    import torch
    import keel
    import keel.integrations.deepspeed as keel_ds
    from ranks import expect_error
    start_deepspeed(rank, world)

    def model_of(*layers: Any) -> Any:
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(layers)
        return model

    messages: List[str] = []
    refused = keel.InvalidArgumentError
    expect_error(messages, refused, lambda: keel_ds.use_keel(torch.nn.Linear(2, 2)))
    other_k = build_moe(rank, world, True)
    other_k.deepspeed_moe.gate.k = 1
    expect_error(messages, refused,
                 lambda: keel_ds.use_keel(model_of(build_moe(rank, world, True), other_k)))
    from deepspeed.moe.layer import MoE
    narrow = MoE(DIM, torch.nn.Linear(DIM, DIM), num_experts=EXPERTS, ep_size=1, k=TOP_K)
    expect_error(messages, refused, lambda: keel_ds.use_keel(model_of(narrow)))
    replaced = build_moe(rank, world, True)
    replaced.deepspeed_moe = torch.nn.Identity()
    expect_error(messages, refused, lambda: keel_ds.use_keel(model_of(replaced)))
    on_meta = build_moe(rank, world, True)
    on_meta.deepspeed_moe.experts.to("meta")
    expect_error(messages, refused, lambda: keel_ds.use_keel(model_of(on_meta)))
    return messages


def test_use_keel_refuses_what_it_cannot_take_by_name() -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    messages = values(run_ranks(refusals, 2, timeout=120))[0]
    expected = [["Linear", "holds no DeepSpeed MoE layer"],
                ["layers.1: 8 experts Sequential", "top-1", "the same experts in every layer"],
                ["layers.0: ep_size = 1, but Keel's group has 2 ranks", "ep_size = 2"],
                ["layers.0.deepspeed_moe is Identity", "already Keel's?"],
                ["layers.0.deepspeed_moe.experts has parameters on the meta device",
                 "after the model's weights are initialized"]]
    assert len(messages) == len(expected), messages
    for message, words in zip(messages, expected):
        for word in words:
            assert word in message, (word, message)
