"""keel.torch checkpoints by logical expert: saved with torch.distributed.checkpoint on 4 ranks
mid-run (an epoch's migration in flight), resumed on 4 ranks and on 2 under fresh placements, the
run goes on as the uninterrupted one; the checkpoint loads into a plain PyTorch MoE's experts and
a plain model's experts load into KeelMoE; a checkpoint that does not fit is refused naming its
keys, before any slot changes; the optimizer's own state dict leaves Keel's slots out, and
an optimizer built with parameter names keeps each name beside its parameter.

The resumed runs sum the same gradients in another order (their placements differ: each plans
from its own load estimates), so they match the uninterrupted run within a tolerance, not bit for
bit: losses 1e-5 relative and weights 1e-4 after 4 more Adam steps. Seen: losses 5.1e-7 (4 ranks)
and 2.1e-6 (2 ranks), weights 2.4e-8."""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest

import test_training_loops as loops
from ranks import run_ranks, values

EXPERTS, TOP_K, HIDDEN, FFN = loops.EXPERTS, loops.TOP_K, loops.HIDDEN, loops.FFN
TOKENS = 48  # per virtual rank
VIRTUAL_RANKS = 4  # the data of 4 ranks, whatever the world size
STEPS = 8
SAVE_AT = 3  # saved after this step's optimizer step


def batch(step: int, rank: int, world: int):
    """This rank's share of the step's tokens: the virtual ranks it stands for, concatenated."""
    import torch
    per_rank = VIRTUAL_RANKS // world
    parts = [loops.batch(step, virtual, TOKENS)
             for virtual in range(rank * per_rank, (rank + 1) * per_rank)]
    return [torch.cat(tensors) for tensors in zip(*parts)]


def make_moe(world: int, seed: int) -> Any:
    import torch
    import keel.torch as kt
    moe = kt.KeelMoE(kt.ffn_expert(HIDDEN, FFN), num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                     config=loops.moe_config("keel", world), average_gradients=False, seed=seed)
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-2)
    moe.attach(optimizer)
    return moe, optimizer


def train(moe: Any, optimizer: Any, rank: int, world: int, steps: range) -> List[float]:
    """The steps' global losses (summed over ranks)."""
    import torch
    import torch.distributed as dist
    losses = []
    for step in steps:
        hidden, ids, weights, probe = batch(step, rank, world)
        loss = (moe.layer(0)(hidden, ids, weights) * probe).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def cpu_experts(moe: Any) -> List[Dict[str, Any]]:
    return [{n: t.cpu() for n, t in e.items()} for e in moe.gather_experts(0)]


def uninterrupted(rank: int, world: int, directory: str) -> Dict[str, Any]:
    """Trains STEPS steps on 4 ranks, saving after step SAVE_AT."""
    import torch.distributed.checkpoint as dcp
    moe, optimizer = make_moe(world, seed=3)
    losses = train(moe, optimizer, rank, world, range(SAVE_AT + 1))
    in_flight = moe.stats()["migration_in_flight"]
    dcp.save({"experts": moe.state_dict(), "adam": moe.optimizer_state_dict()},
             checkpoint_id=directory)
    at_save = cpu_experts(moe)
    slot_state = len(optimizer.state_dict()["state"])
    losses += train(moe, optimizer, rank, world, range(SAVE_AT + 1, STEPS))
    result = {"losses": losses, "experts": cpu_experts(moe), "at_save": at_save,
              "in_flight": in_flight, "epochs": moe.stats()["epochs_committed"],
              "slot_state_in_optimizer_dict": slot_state}
    moe.close()
    return result


def resumed(rank: int, world: int, directory: str) -> Dict[str, Any]:
    """A fresh KeelMoE (other initial weights, its own placement for `world` ranks) loads the
    checkpoint and trains the remaining steps."""
    import torch.distributed.checkpoint as dcp
    moe, optimizer = make_moe(world, seed=99)
    # Loaded into copies, then checked and copied in: all or nothing.
    state = {"experts": {k: v.clone() for k, v in moe.state_dict().items()},
             "adam": {k: v.clone() for k, v in moe.optimizer_state_dict().items()}}
    dcp.load(state, checkpoint_id=directory)
    moe.load_state_dict(state["experts"])
    moe.load_optimizer_state_dict(state["adam"])
    losses = train(moe, optimizer, rank, world, range(SAVE_AT + 1, STEPS))
    result = {"losses": losses, "experts": cpu_experts(moe)}
    moe.close()
    return result


def relative(got: Any, want: Any) -> float:
    return float((got - want).abs().max()) / (1.0 + float(want.abs().max()))


def on_4_ranks(rank: int, world: int, directory: str) -> Dict[str, Any]:
    """The uninterrupted run, then the refusals and an optimizer with parameter names (each on a
    fresh KeelMoE): one launch for the three."""
    return {"uninterrupted": uninterrupted(rank, world, directory),
            "refusals": refuse_bad_checkpoints(rank, world),
            "named": named_optimizer_round_trip(rank, world)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Dict[str, Any]:
    """Every rank's answer of on_4_ranks, and the checkpoint's folder under "directory"."""
    directory = str(tmp_path_factory.mktemp("saved") / "checkpoint")
    answers = values(run_ranks(on_4_ranks, 4, directory, timeout=240))
    return {"directory": directory, "ranks": answers}


def test_a_checkpoint_resumes_on_4_and_2_ranks_and_loads_into_a_plain_model(
        four_ranks: Dict[str, Any]) -> None:
    directory = four_ranks["directory"]
    whole = four_ranks["ranks"][0]["uninterrupted"]
    assert whole["epochs"] >= 1, "no epoch committed: the placement never changed"
    assert whole["in_flight"], "no migration was in flight when the checkpoint was saved"
    assert whole["slot_state_in_optimizer_dict"] == 0, "the optimizer's dict holds Keel's slots"
    for world in (4, 2):
        again = values(run_ranks(resumed, world, directory, timeout=240))[0]
        tail = whole["losses"][SAVE_AT + 1:]
        for step, (got, want) in enumerate(zip(again["losses"], tail), start=SAVE_AT + 1):
            assert abs(got - want) <= 1e-5 * (1 + abs(want)), (
                f"{world} ranks, step {step}: loss {got} resumed, {want} uninterrupted")
        worst = max(relative(again["experts"][e][n], w)
                    for e in range(EXPERTS) for n, w in whole["experts"][e].items())
        assert worst < 1e-4, f"{world} ranks: final weights differ by {worst} (relative)"
    assert plain_model_loads(directory, whole["at_save"]) == []


def plain_model_loads(directory: str, experts: List[Dict[str, Any]]) -> List[str]:
    """A plain PyTorch MoE layer's experts (a ModuleList, no Keel, no process group) load the
    checkpoint by their own state dict's keys."""
    import torch
    import torch.distributed.checkpoint as dcp

    class Expert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            import keel.torch as kt
            for name, shape in kt.ffn_expert(HIDDEN, FFN).shapes.items():
                self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))

    plain = torch.nn.ModuleDict({"experts": torch.nn.ModuleList(Expert()
                                                                for _ in range(EXPERTS))})
    state = {"experts": {f"layers.0.{k}": v for k, v in plain.state_dict().items()}}
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    plain.load_state_dict({k[len("layers.0."):]: v for k, v in state["experts"].items()})
    problems = []
    for e in range(EXPERTS):
        for name, want in experts[e].items():
            got = getattr(plain.experts[e], name).detach()
            if not torch.equal(got, want):
                problems.append(f"expert {e} {name} differs")
    return problems


def refuse_bad_checkpoints(rank: int, world: int) -> List[str]:
    """Each bad checkpoint is refused naming its key and leaves every slot as it was; a plain
    model's experts load; the optimizer's own state dict leaves Keel's slots out and loading it
    keeps Keel's Adam state where the engine moves it."""
    import torch
    import keel
    moe, optimizer = make_moe(world, seed=3)
    layer = moe.layer(0)
    problems: List[str] = []

    def slots() -> List[Any]:
        return [p.detach().clone() for p in layer.parameters()]

    good = {k: v.clone() for k, v in moe.state_dict().items()}
    held = sorted({int(k.split(".")[3]) for k in good})
    first = f"layers.0.experts.{held[0]}"
    cases = {
        "missing": ({k: v for k, v in good.items() if k != f"{first}.w1"}, f"{first}.w1: missing"),
        "shape": ({**good, f"{first}.w1": torch.zeros(3, 3)}, f"{first}.w1: shape [3, 3]"),
        "dtype": ({**good, f"{first}.w2": good[f"{first}.w2"].long()},
                  f"{first}.w2: expected a floating-point tensor"),
        "unknown expert": ({**good, "layers.0.experts.99.w1": good[f"{first}.w1"]},
                           "layers.0.experts.99.w1: not a layer's expert parameter"),
        "unknown key": ({**good, "router.weight": torch.zeros(2)},
                        "router.weight: not a key of KeelMoE.state_dict()"),
    }
    before = slots()
    for case, (state, message) in cases.items():
        try:
            moe.load_state_dict(state)
            problems.append(f"{case}: accepted")
        except keel.InvalidArgumentError as error:
            if message not in str(error):
                problems.append(f"{case}: {error}")
        if not all(torch.equal(a, b) for a, b in zip(slots(), before)):
            problems.append(f"{case}: a slot changed")
    # Through torch's own load_state_dict: torch raises, this layer stays as it was.
    try:
        layer.load_state_dict({k[len("layers.0."):]: v for k, v in cases["shape"][0].items()})
        problems.append("module load: accepted a wrong shape")
    except RuntimeError as error:
        if "shape [3, 3]" not in str(error):
            problems.append(f"module load: {error}")
    if not all(torch.equal(a, b) for a, b in zip(slots(), before)):
        problems.append("module load: a slot changed")
    adam = {k: v.clone() for k, v in moe.optimizer_state_dict().items()}
    if adam:
        missing = dict(adam)
        missing.pop(next(iter(adam)))
        try:
            moe.load_optimizer_state_dict(missing)
            problems.append("optimizer state: accepted a missing entry")
        except keel.InvalidArgumentError as error:
            if f"{next(iter(adam))}: missing" not in str(error):
                problems.append(f"optimizer state: {error}")
    # A plain model's experts (every expert, the same values on every rank) load by their keys.
    plain = {f"layers.0.experts.{e}.{name}": torch.full(shape, float(e + 1))
             for e in range(EXPERTS) for name, shape in moe.spec.shapes.items()}
    moe.load_state_dict(plain)
    for e, params in enumerate(moe.gather_experts(0)):
        for name, value in params.items():
            if not torch.equal(value, plain[f"layers.0.experts.{e}.{name}"]):
                problems.append(f"plain model: expert {e} {name} did not load")
    # One step, then the optimizer's dict round trip keeps the Adam state in Keel's buffers.
    train(moe, optimizer, rank, world, range(1))
    saved = optimizer.state_dict()
    if saved["state"]:
        problems.append(f"the optimizer's dict holds {len(saved['state'])} slot states")
    optimizer.load_state_dict(saved)
    views = moe.optimizer_state_dict()
    for local in range(moe.engine.slots_per_rank):
        for name, param in layer.slots[local].items():
            state = optimizer.state[param]["exp_avg"]
            buffer = layer._optimizer[local]
            start = buffer.data_ptr()
            if not start <= state.data_ptr() < start + buffer.numel():
                problems.append(f"slot {local} {name}: Adam state left the engine's buffer")
    if not views:
        problems.append("no home on this rank: the test proves less")
    moe.close()
    return problems


def test_bad_checkpoints_are_refused_before_anything_changes(four_ranks: Dict[str, Any]) -> None:
    for rank, answer in enumerate(four_ranks["ranks"]):
        assert answer["refusals"] == [], f"rank {rank}: {answer['refusals']}"


def named_optimizer_round_trip(rank: int, world: int) -> List[str]:
    """An optimizer built with parameter names (torch >= 2.6; torchtitan builds its own so): its
    state dict without Keel's slots keeps every name beside its parameter, and loading it gives
    a dense parameter its state back and Keel's slots their views."""
    import torch
    import keel.torch as kt
    moe = kt.KeelMoE(kt.ffn_expert(HIDDEN, FFN), num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                     config=loops.moe_config("keel", world), average_gradients=False, seed=3)
    layer = moe.layer(0)
    before = torch.nn.Parameter(torch.ones(3))
    after = torch.nn.Parameter(torch.ones(5))
    named = ([("before", before)] + [(f"layers.0.{n}", p) for n, p in layer.named_parameters()]
             + [("after", after)])
    optimizer = torch.optim.Adam(named, lr=1e-2)
    moe.attach(optimizer)
    hidden, ids, weights, probe = batch(0, rank, world)
    ((layer(hidden, ids, weights) * probe).sum() + before.sum() + 2 * after.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    problems = []
    saved = copy.deepcopy(optimizer.state_dict())  # its per-parameter dicts are the optimizer's
    group = saved["param_groups"][0]
    # The persistent slots leave; transient slots stay, without state (never a home).
    persistent = {id(p) for local in range(moe.engine.slots_per_rank)
                  for p in layer.slots[local].values()}
    if group["param_names"] != [n for n, p in named if id(p) not in persistent]:
        moe.close()
        return [f"names beside the parameters left: {group['param_names']}"]
    shapes = {name: tuple(saved["state"][index]["exp_avg"].shape)
              for name, index in zip(group["param_names"], group["params"])
              if index in saved["state"]}
    if shapes != {"before": (3,), "after": (5,)}:
        problems.append(f"the states under the names: {shapes}")
    kept = saved["state"][group["params"][-1]]["exp_avg"].clone()
    optimizer.state[after]["exp_avg"].zero_()
    optimizer.load_state_dict(saved)
    if not torch.equal(optimizer.state[after]["exp_avg"], kept):
        problems.append("the dense parameter's state did not come back")
    if optimizer.param_groups[0]["param_names"] != [n for n, _ in named]:
        problems.append(f"names after loading: {optimizer.param_groups[0]['param_names']}")
    for local in range(moe.engine.slots_per_rank):
        buffer = layer._optimizer[local]
        for name, param in layer.slots[local].items():
            at = optimizer.state[param]["exp_avg"].data_ptr()
            if not buffer.data_ptr() <= at < buffer.data_ptr() + buffer.numel():
                problems.append(f"slot {local} {name}: Adam state left the engine's buffer")
    moe.close()
    return problems


def test_an_optimizer_with_parameter_names_keeps_them_beside_their_parameters(
        four_ranks: Dict[str, Any]) -> None:
    for rank, answer in enumerate(four_ranks["ranks"]):
        assert answer["named"] == [], f"rank {rank}: {answer['named']}"
