"""What keel.torch does with bad input, with a lost rank, and across a checkpoint, on every test
device (ranks.DEVICES): bad tensors, ids, configs and groups raise an exception naming the
argument and its value; a rank that dies mid-step makes the others raise within the collective
deadline instead of hanging; a checkpoint of the engine state and the experts loads into a new
engine, and one with a bad expert file is refused by file and field without changing a weight."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Dict, List

import pytest

import ranks
from ranks import DEVICES, run_ranks, values


def bad_inputs(rank: int, world: int, device: str) -> List[str]:
    """One rank: every bad call, and the message each raised (or a note that it did not)."""
    import torch
    import keel
    import keel.torch as kt

    messages: List[str] = []

    def expect_error(kind: type, call: Any) -> None:
        ranks.expect_error(messages, kind, call)

    config = {"topology": {"num_nodes": 1, "gpus_per_node": 1},
              "slots": {"persistent_per_rank": 4, "transient_per_rank": 0},
              "policy": {"name": "static"}, "migration": {"transport": "ucx"}}
    moe = kt.KeelMoE(kt.ffn_expert(8, 16), num_layers=1, num_experts=4, top_k=2, config=config,
                     device=device)
    layer = moe.layer(0)
    hidden = torch.randn(5, 8, device=device)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], device=device)
    weights = torch.full((5, 2), 0.5, device=device)
    expect_error(keel.InvalidArgumentError, lambda: layer(hidden, ids.float(), weights))
    expect_error(keel.InvalidArgumentError, lambda: layer(hidden, ids[:, :1], weights))
    expect_error(keel.InvalidArgumentError, lambda: layer(hidden, ids.to("meta"), weights))
    expect_error(keel.InvalidArgumentError, lambda: layer(hidden.double(), ids, weights))
    expect_error(keel.InvalidArgumentError, lambda: layer(hidden, ids, weights[:4]))
    out_of_range = ids.clone()
    out_of_range[3, 1] = 9
    expect_error(keel.InvalidArgumentError, lambda: layer(hidden, out_of_range, weights))
    # The engine is still usable after refusing bad input.
    out = layer(hidden, ids, weights)
    messages.append(f"ok {list(out.shape)}")
    expect_error(keel.InvalidArgumentError, lambda: moe.attach(torch.optim.SGD(
        moe.parameters(), lr=0.1)))
    # A state with sharded experts would route more rows than entries: refused before it is used.
    state = json.loads(moe.engine.save_state())
    state["shards"] = [[1, 2, 1, 1]]
    expect_error(keel.InvalidArgumentError, lambda: moe.engine.restore_state(json.dumps(state)))
    moe.close()
    # A config whose ranks differ from the group's.
    four = dict(config, topology={"num_nodes": 1, "gpus_per_node": 4})
    expect_error(keel.InvalidArgumentError, lambda: kt.KeelMoE(
        kt.ffn_expert(8, 16), num_layers=1, num_experts=4, top_k=2, config=four))
    expect_error(keel.InvalidArgumentError, lambda: kt.KeelMoE(
        kt.ffn_expert(8, 16), num_layers=1, num_experts=4, top_k=2,
        config=dict(config, policy={"name": "roundrobin"})))
    # Sharded experts route an entry to every shard: only the C++ API carries those rows.
    expect_error(keel.InvalidArgumentError, lambda: kt.KeelMoE(
        kt.ffn_expert(8, 16), num_layers=1, num_experts=4, top_k=2,
        config=dict(config, policy={"name": "keel", "keel": {"shard_experts": True,
                                                            "transient_replicas": False}})))
    return messages


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_names_the_argument_and_value(device: str) -> None:
    messages = values(run_ranks(bad_inputs, 1, device, device=device))[0]
    expected = [
        "topk_ids has dtype float32, expected int32 or int64",
        "topk_ids has shape [5, 1]: dimension 1 is 1, expected 2",
        "topk_ids is on device meta",
        "hidden has dtype float64, expected float32",
        "topk_weights has shape [4, 2]: dimension 0 is 4, expected 5",
        "topk_ids[7] = 9 is not an expert id in [0, 4) or -1",
        "ok [5, 8]",
        "optimizer is SGD, but KeelMoE was created with optimizer='adam'",
        "the state has sharded experts, whose routes need the C++ API",
        "topology.num_nodes x topology.gpus_per_node = 4 ranks, but the communicator has 1",
        "policy.name: roundrobin is not allowed",
        "policy.keel.shard_experts = true routes an entry of a sharded expert to every shard",
    ]
    assert len(messages) == len(expected), messages
    for got, want in zip(messages, expected):
        assert want in got, f"expected {want!r} in {got!r}"


DEADLINE = 5.0


def lose_a_rank(rank: int, world: int, how: str, device: str) -> Dict[str, Any]:
    """Trains until rank `world - 1` dies (or stalls) at the start of step 2; the others report
    what they raised and how long after that step began."""
    import torch
    import keel.torch as kt

    config = {"topology": {"num_nodes": 1, "gpus_per_node": world},
              "slots": {"persistent_per_rank": 3, "transient_per_rank": 1},
              "migration": {"transport": "ucx", "deadline_seconds": DEADLINE},
              "engine": {"collective_timeout_seconds": DEADLINE}}
    moe = kt.KeelMoE(kt.ffn_expert(8, 16), num_layers=2, num_experts=8, top_k=2, config=config,
                     device=device)
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-2, fused=device == "cuda")
    moe.attach(optimizer)
    generator = torch.Generator().manual_seed(rank)
    for step in range(5):
        started = time.monotonic()
        if step == 2 and rank == world - 1:
            if how == "dies":
                os._exit(1)  # the process dies between steps, without a word to anyone
            time.sleep(4 * DEADLINE)  # stuck, as in a long kernel or a debugger
        try:
            x = torch.randn(32, 8, generator=generator).to(device)
            for layer in range(2):
                ids = torch.randint(0, 8, (32, 2), generator=generator).to(device)
                x = x + moe.layer(layer)(x, ids, torch.full((32, 2), 0.5, device=device))
            x.sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        except Exception as error:  # what a trainer would see
            return {"step": step, "type": type(error).__name__, "message": str(error),
                    "seconds": time.monotonic() - started,
                    "bases": [c.__name__ for c in type(error).__mro__]}
    return {"step": None}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_lost_rank_is_an_error_within_the_deadline(how: str, device: str) -> None:
    answers = run_ranks(lose_a_rank, 4, how, device, timeout=90, allow_missing=[3],
                        device=device)
    survivors = [answers[r] for r in range(3)]
    for rank, (status, result) in enumerate(survivors):
        assert status == "ok", result
        assert result["step"] == 2, f"rank {rank} raised nothing when rank 3 died: {result}"
        assert {"TimeoutError", "KeelError", "RuntimeError"} & set(result["bases"]), result
        if how == "stalls":
            assert "TimeoutError" in result["bases"], result  # keel.DeadlineExceededError
        assert result["seconds"] < 3 * DEADLINE, f"rank {rank} took {result['seconds']:.1f} s"


def test_waiting_on_the_gpu_keeps_the_deadline() -> None:
    """The host's wait for an NCCL collective or the GPU's queue (keel.torch.communicator.
    wait_until): returns as soon as the work is done, and raises the caller's TimeoutError
    once the deadline has passed, never before."""
    from keel.torch.communicator import wait_until

    checks = []
    wait_until(lambda: checks.append(1) or len(checks) == 5, 10.0, lambda: "unused")
    assert len(checks) == 5
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="all-to-all did not complete"):
        wait_until(lambda: False, 0.2, lambda: "all-to-all did not complete within 0.2 s")
    assert time.monotonic() - started >= 0.2
    wait_until(lambda: True, None, lambda: "unused")  # no deadline, already done


def checkpoint_round_trip(rank: int, world: int, folder: str, device: str) -> Dict[str, Any]:
    """Trains 3 steps, checkpoints the engine state and the experts, then loads them into a new
    KeelMoE with other initial weights; returns what matched and what a bad state raised."""
    import torch
    import keel
    import keel.torch as kt

    config = {"topology": {"num_nodes": 1, "gpus_per_node": world},
              "slots": {"persistent_per_rank": 4, "transient_per_rank": 0},
              "policy": {"name": "static"}, "migration": {"transport": "ucx"}}
    moe = kt.KeelMoE(kt.ffn_expert(8, 16), num_layers=1, num_experts=4, top_k=2, config=config,
                     device=device)
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-2, fused=device == "cuda")
    moe.attach(optimizer)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(16, 8, generator=generator).to(device)
        ids = torch.randint(0, 4, (16, 2), generator=generator).to(device)
        moe.layer(0)(x, ids, torch.full((16, 2), 0.5, device=device)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = moe.engine.save_state()
    moe.engine.save_experts(folder)
    trained = [p.detach().clone() for p in moe.parameters()]
    moe.close()

    fresh = kt.KeelMoE(kt.ffn_expert(8, 16), num_layers=1, num_experts=4, top_k=2,
                       config=config, seed=12345, device=device)
    differed = any(not torch.equal(a, b) for a, b in zip(trained, fresh.parameters()))
    fresh.engine.restore_state(state)
    fresh.engine.load_experts(folder)
    loaded = all(torch.equal(a, b) for a, b in zip(trained, fresh.parameters()))
    try:
        fresh.engine.restore_state('{"keel_engine_state": 1, "epoch": -1}')
        bad = "NO ERROR"
    except keel.InvalidArgumentError as error:
        bad = str(error)
    fresh.close()
    return {"differed": differed, "loaded": loaded, "bad": bad,
            "state_epoch": __import__("json").loads(state)["epoch"]}


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_loads_the_trained_experts_into_a_new_engine(tmp_path, device: str) -> None:
    answer = values(run_ranks(checkpoint_round_trip, 1, str(tmp_path / "experts"), device,
                              device=device))[0]
    assert answer["differed"], "the new engine started from the trained weights already"
    assert answer["loaded"], "load_experts did not bring back the trained weights"
    assert answer["state_epoch"] == 0
    assert "epoch -1 is negative" in answer["bad"], answer["bad"]


def checkpoint_refusals(rank: int, world: int, folder: str, device: str) -> Dict[str, Any]:
    """Saves the experts, refusing an empty folder and the root; then loads copies with a flipped
    bit and with one expert's file over another's into a new KeelMoE. Returns each message and
    whether the new model's weights stayed as they were."""
    import torch
    import keel
    import keel.torch as kt

    config = {"topology": {"num_nodes": 1, "gpus_per_node": world},
              "slots": {"persistent_per_rank": 4, "transient_per_rank": 0},
              "policy": {"name": "static"}, "migration": {"transport": "ucx"}}
    moe = kt.KeelMoE(kt.ffn_expert(8, 16), num_layers=1, num_experts=4, top_k=2, config=config,
                     device=device)
    messages: Dict[str, Any] = {}

    def message(name: str, call: Any) -> None:
        try:
            call()
            messages[name] = "NO ERROR"
        except keel.InvalidArgumentError as error:
            messages[name] = str(error)

    message("empty", lambda: moe.engine.save_experts(""))
    message("root", lambda: moe.engine.save_experts("/"))
    moe.engine.save_experts(folder)
    moe.close()

    fresh = kt.KeelMoE(kt.ffn_expert(8, 16), num_layers=1, num_experts=4, top_k=2,
                       config=config, seed=12345, device=device)
    before = [p.detach().clone() for p in fresh.parameters()]
    flipped = folder + "-flipped"
    shutil.copytree(folder, flipped)
    path = os.path.join(flipped, "layer-0", "expert-3.bin")
    data = bytearray(open(path, "rb").read())
    data[100] ^= 0x08
    open(path, "wb").write(bytes(data))
    message("flipped", lambda: fresh.engine.load_experts(flipped))
    swapped = folder + "-swapped"
    shutil.copytree(folder, swapped)
    shutil.copyfile(os.path.join(swapped, "layer-0", "expert-1.bin"),
                    os.path.join(swapped, "layer-0", "expert-3.bin"))
    message("swapped", lambda: fresh.engine.load_experts(swapped))
    messages["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    fresh.engine.load_experts(folder)
    messages["loaded"] = not all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    fresh.close()
    messages["root_written"] = os.path.exists("/layer-0/expert-0.bin")
    return messages


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_checkpoint_is_refused_without_changing_a_weight(tmp_path, device: str) -> None:
    folder = str(tmp_path / "experts")
    answer = values(run_ranks(checkpoint_refusals, 1, folder, device, device=device))[0]
    assert "SaveExperts: dir is empty" in answer["empty"], answer["empty"]
    assert "SaveExperts: dir '/' is the filesystem root" in answer["root"], answer["root"]
    assert not answer["root_written"]
    expert_3 = os.path.join(folder + "-flipped", "layer-0", "expert-3.bin")
    assert f"{expert_3}: checksum: expected 0x" in answer["flipped"], answer["flipped"]
    expert_3 = os.path.join(folder + "-swapped", "layer-0", "expert-3.bin")
    assert f"{expert_3}: expert: expected 3, found 1" in answer["swapped"], answer["swapped"]
    assert answer["unchanged"], "a refused load changed the model's weights"
    assert answer["loaded"], "the intact checkpoint did not load"
