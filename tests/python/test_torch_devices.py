"""keel.torch's devices and dtypes: arguments on the wrong device, on two different GPUs, or of a
dtype keel does not take are refused with keel.InvalidArgumentError naming the argument and its
device or dtype; a one-rank NCCL group (the engine's slot exchanges device to device) trains
exactly like a one-rank gloo group on the same GPU."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

import ranks
from ranks import DEVICES, run_ranks, values

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="torch sees no CUDA device on this machine")


def refusals(rank: int, world: int, device: str) -> List[str]:
    """Every refused call's message, in order (or a note that one was not refused)."""
    import keel
    import keel.torch as kt

    messages: List[str] = []

    def expect_error(call: Any) -> None:
        ranks.expect_error(messages, keel.InvalidArgumentError, call)

    config = {"topology": {"num_nodes": 1, "gpus_per_node": 1},
              "slots": {"persistent_per_rank": 4, "transient_per_rank": 0},
              "policy": {"name": "static"}, "migration": {"transport": "ucx"}}
    spec = kt.ffn_expert(8, 16)
    expect_error(lambda: kt.KeelMoE(spec, num_layers=1, num_experts=4, top_k=2, config=config,
                                    device=device, dtype=torch.float64))
    expect_error(lambda: kt.KeelMoE(spec, num_layers=1, num_experts=4, top_k=2, config=config,
                                    device="meta"))
    moe = kt.KeelMoE(spec, num_layers=1, num_experts=4, top_k=2, config=config, device=device)
    layer = moe.layer(0)
    hidden = torch.randn(5, 8, device=device)
    ids = torch.randint(0, 4, (5, 2), device=device)
    weights = torch.full((5, 2), 0.5, device=device)
    expect_error(lambda: layer(hidden.to(torch.int32), ids, weights))
    expect_error(lambda: layer(hidden, ids, weights.double()))
    if device == "cuda":
        expect_error(lambda: layer(hidden.cpu(), ids, weights))
        expect_error(lambda: layer(hidden, ids.cpu(), weights))
        expect_error(lambda: layer(hidden, ids, weights.cpu()))
        if torch.cuda.device_count() > 1:
            expect_error(lambda: layer(hidden, ids.to("cuda:1"), weights))
    elif not torch.cuda.is_available():
        expect_error(lambda: kt.KeelMoE(spec, num_layers=1, num_experts=4, top_k=2,
                                        config=config, device="cuda"))
    out = layer(hidden, ids, weights)  # still usable after every refusal
    messages.append(f"ok {list(out.shape)} {out.device.type}")
    # No tokens, and tokens whose every choice is dropped: nothing to send, zeros back.
    moe.end_forward_pass()
    empty = layer(hidden[:0], ids[:0], weights[:0])
    moe.end_forward_pass()
    dropped = layer(hidden, torch.full_like(ids, -1), weights)
    messages.append(f"empty {list(empty.shape)}, dropped {float(dropped.abs().sum())}")
    moe.close()
    return messages


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_devices_and_dtypes_are_named(device: str) -> None:
    messages = values(run_ranks(refusals, 1, device, device=device))[0]
    expected = ["dtype = torch.float64 is not one of torch.float32, torch.bfloat16, "
                "torch.float16",
                "device = 'meta': keel takes CPU or CUDA devices",
                "hidden has dtype int32, expected float32 or bfloat16 or float16",
                "topk_weights has dtype float64, expected float32 or bfloat16 or float16"]
    if device == "cuda":
        expected += ["hidden is on device cpu; expected tensors on cuda:0",
                     "topk_ids is on device cpu; expected tensors on cuda:0",
                     "topk_weights is on device cpu; expected tensors on cuda:0"]
        if torch.cuda.device_count() > 1:
            expected.append("topk_ids is on device cuda:1; expected tensors on cuda:0")
    elif not torch.cuda.is_available():
        expected.append("device = 'cuda', but torch sees no CUDA device")
    expected.append(f"ok [5, 8] {device}")
    expected.append("empty [0, 8], dropped 0.0")
    assert len(messages) == len(expected), messages
    for got, want in zip(messages, expected):
        assert want in got, f"expected {want!r} in {got!r}"


def train_one_rank(rank: int, world: int, steps: int) -> Dict[str, Any]:
    """A few Adam steps of one layer on this process's GPU; the final experts and outputs."""
    import keel.torch as kt

    config = {"topology": {"num_nodes": 1, "gpus_per_node": 1},
              "slots": {"persistent_per_rank": 6, "transient_per_rank": 0},
              "policy": {"name": "static"}, "migration": {"transport": "ucx"}}
    moe = kt.KeelMoE(kt.ffn_expert(16, 32), num_layers=2, num_experts=6, top_k=2,
                     config=config, device="cuda", dtype=torch.bfloat16, seed=4)
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-2, fused=True)
    moe.attach(optimizer)
    generator = torch.Generator().manual_seed(9)
    outputs = []
    for _ in range(steps):
        x = torch.randn(64, 16, generator=generator).to("cuda", torch.bfloat16)
        for layer in range(2):
            ids = torch.randint(0, 6, (64, 2), generator=generator).cuda()
            x = x + moe.layer(layer)(x, ids, torch.full((64, 2), 0.5, device="cuda"))
        outputs.append(x.float().cpu())
        x.float().square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    experts = [{n: t.float().cpu() for n, t in e.items()} for e in moe.gather_experts(1)]
    moe.close()
    return {"outputs": outputs, "experts": experts}


@NEEDS_CUDA
def test_a_one_rank_nccl_group_trains_like_gloo() -> None:
    nccl = values(run_ranks(train_one_rank, 1, 4, backend="nccl", device="cuda"))[0]
    gloo = values(run_ranks(train_one_rank, 1, 4, backend="gloo", device="cuda"))[0]
    for step, (a, b) in enumerate(zip(nccl["outputs"], gloo["outputs"])):
        assert torch.equal(a, b), f"step {step}: outputs differ by {(a - b).abs().max()}"
    for e, (a, b) in enumerate(zip(nccl["experts"], gloo["experts"])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"expert {e} {name} differs"
