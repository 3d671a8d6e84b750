"""keel.torch in the training loops of real runs, on 4 real ranks: several micro-batches per
optimizer step (gradient accumulation), activation recomputation with torch.utils.checkpoint
(reentrant and not), evaluation passes between steps without extra calls, torch.compile around a
block with a KeelMoE layer, and two misuses: attaching the optimizer hooks twice, and one engine
driven from two threads.

Gradient accumulation: one batch per step and the same tokens in 4 micro-batches give the same
home gradients and, after SGD, the same weights, under the static and the keel placement (epochs
committed while the micro-batches run). Only the order of the float32 sums differs (each slot
adds 4 partial gradients, and the quotas split each expert's tokens differently per
micro-batch): relative tolerance 1e-5; the largest differences seen are 9.7e-7 (gradients) and
4.4e-7 (weights after 6 steps). Recomputation routes
nothing again and reuses each micro-batch's routing, so its gradients are bitwise those of the
run without it."""

from __future__ import annotations

from typing import Any, Dict, List

from ranks import run_ranks, values

RANKS = 4
EXPERTS = 8
TOP_K = 2
HIDDEN = 16
FFN = 24
TOKENS = 96
MICRO_BATCHES = 4


def moe_config(policy: str, world: int = RANKS) -> Dict[str, Any]:
    """One node of `world` ranks, a spare slot and a transient slot each, a replan every step
    adopted at the next one (epochs at the same steps however busy the machine is)."""
    return {
        "topology": {"num_nodes": 1, "gpus_per_node": world},
        "slots": {"persistent_per_rank": EXPERTS // world + 1, "transient_per_rank": 1},
        # Tiny experts on slow "GPUs": compute dominates, so replicas and transients pay.
        "cost_model": {"hidden_size": HIDDEN, "expert_ffn_size": FFN, "expert_tflops": 1e-6,
                       "dtype_bytes": 4},
        "policy": {"name": policy, "replan_interval_steps": 1, "plan_adoption": "next_step"},
        "migration": {"transport": "ucx", "deadline_seconds": 20},
        "engine": {"collective_timeout_seconds": 60},
    }


def batch(step: int, rank: int, tokens: int = TOKENS):
    """This rank's tokens, router ids (skewed toward two hot experts that drift), weights and a
    probe for the loss."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    hot = torch.tensor([(step // 2) % EXPERTS, (step // 2 + 3) % EXPERTS])
    first = torch.where(torch.rand(tokens, generator=g) < 0.7,
                        hot[torch.randint(0, 2, (tokens,), generator=g)],
                        torch.randint(0, EXPERTS, (tokens,), generator=g))
    second = (first + 1 + torch.randint(0, EXPERTS - 1, (tokens,), generator=g)) % EXPERTS
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=1)
    probe = torch.randn(tokens, HIDDEN, generator=g)
    return hidden, torch.stack([first, second], dim=1), weights, probe


def count_routes(moe: Any) -> List[int]:
    """Counts the engine's routes of this KeelMoE from now on: [routes]."""
    routes = [0]
    route_counts = moe.engine.route_counts

    def counted(layer: int, counts: Any) -> Any:
        routes[0] += 1
        return route_counts(layer, counts)

    moe.engine.route_counts = counted
    return routes


def accumulate(rank: int, world: int, policy: str, steps: int) -> Dict[str, Any]:
    """The same steps trained twice from the same start: one batch per step, then the batch in
    MICRO_BATCHES micro-batches. Returns the largest relative difference of the home gradients
    and of the final weights, the epochs each run committed and the routes it made."""
    import torch
    import keel.torch as kt

    spec = kt.ffn_expert(HIDDEN, FFN)
    runs = []
    for micro_batches in (1, MICRO_BATCHES):
        moe = kt.KeelMoE(spec, num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                         config=moe_config(policy), optimizer="none", average_gradients=False,
                         seed=3)
        layer = moe.layer(0)
        optimizer = torch.optim.SGD(moe.parameters(), lr=0.05)
        moe.attach(optimizer)
        routes = count_routes(moe)
        gradients = []
        for step in range(steps):
            hidden, ids, weights, probe = batch(step, rank)
            for part in range(micro_batches):
                rows = slice(part * TOKENS // micro_batches, (part + 1) * TOKENS // micro_batches)
                out = layer(hidden[rows], ids[rows], weights[rows])
                (out * probe[rows]).sum().backward()
            moe.reduce_gradients()
            gradients.append({(e, n): p.grad.clone()
                              for e, params in layer.home_parameters().items()
                              for n, p in params.items()})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        experts = moe.gather_experts(0)
        runs.append({"gradients": gradients, "experts": experts, "routes": routes[0],
                     "epochs": moe.stats()["epochs_committed"]})
        moe.close()

    def relative(got: Any, want: Any) -> float:
        return float((got - want).abs().max()) / (1.0 + float(want.abs().max()))

    one, many = runs
    worst_gradient = max(relative(many["gradients"][s][key], grad)
                         for s in range(steps) for key, grad in one["gradients"][s].items())
    worst_weight = max(relative(many["experts"][e][n], w)
                       for e in range(EXPERTS) for n, w in one["experts"][e].items())
    return {"gradient": worst_gradient, "weight": worst_weight,
            "epochs": (one["epochs"], many["epochs"]), "routes": (one["routes"], many["routes"])}


def accumulate_under_both(rank: int, world: int, steps: int) -> Dict[str, Any]:
    """accumulate under the static and the keel placement, in one launch of the ranks."""
    return {policy: accumulate(rank, world, policy, steps) for policy in ("static", "keel")}


def test_micro_batches_give_one_batchs_gradients_and_weights() -> None:
    steps = 6
    by_rank = values(run_ranks(accumulate_under_both, RANKS, steps, timeout=280))
    for policy in ("static", "keel"):
        results = [answer[policy] for answer in by_rank]
        for rank, result in enumerate(results):
            assert result["gradient"] < 1e-5, f"{policy}, rank {rank}: gradients differ: {result}"
            assert result["weight"] < 1e-5, f"{policy}, rank {rank}: weights differ: {result}"
            assert result["routes"] == (steps, steps * MICRO_BATCHES), (policy, result)
    keel = by_rank[0]["keel"]
    assert keel["epochs"][1] >= 1, "no epoch committed under micro-batches"
    assert keel["epochs"][0] == keel["epochs"][1], (
        "the planner saw other traffic per step with micro-batches")


def recompute(rank: int, world: int, mode: str) -> Dict[str, Any]:
    """Two micro-batches of a block (router + KeelMoE layer) per step, without checkpointing or
    under torch.utils.checkpoint (`mode`: none, reentrant, non-reentrant); returns the gradients
    of the input, the router and the home experts, and the routes the engine made."""
    import torch
    from torch.utils.checkpoint import checkpoint
    import keel.torch as kt

    torch.manual_seed(11)
    router = torch.nn.Linear(HIDDEN, EXPERTS)
    spec = kt.ffn_expert(HIDDEN, FFN)
    moe = kt.KeelMoE(spec, num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                     config=moe_config("keel"), optimizer="none", average_gradients=False,
                     seed=3)
    layer = moe.layer(0)
    optimizer = torch.optim.SGD(list(moe.parameters()) + list(router.parameters()), lr=0.05)
    moe.attach(optimizer)
    routes = count_routes(moe)

    def block(x: Any) -> Any:
        scores = torch.softmax(router(x), dim=1)
        weights, ids = torch.topk(scores, TOP_K, dim=1)
        return layer(x, ids, weights)

    found: Dict[str, Any] = {}
    for step in range(3):
        hidden, _, _, probe = batch(step, rank)
        x = hidden.requires_grad_(True)
        for part in range(2):
            rows = slice(part * TOKENS // 2, (part + 1) * TOKENS // 2)
            if mode == "none":
                out = block(x[rows])
            else:
                out = checkpoint(block, x[rows], use_reentrant=mode == "reentrant")
            (out * probe[rows]).sum().backward()
        moe.reduce_gradients()
        found[f"input {step}"] = x.grad.clone()
        for name, p in router.named_parameters():
            found[f"router {name} {step}"] = p.grad.clone()
        for e, params in layer.home_parameters().items():
            for name, p in params.items():
                found[f"expert {e} {name} {step}"] = p.grad.clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    moe.close()
    return {"gradients": found, "routes": routes[0]}


def recompute_every_mode(rank: int, world: int) -> Dict[str, Any]:
    """recompute without checkpointing and in both modes of it, in one launch of the ranks."""
    return {mode: recompute(rank, world, mode) for mode in ("none", "reentrant", "non-reentrant")}


def test_recomputation_reuses_the_routing_and_gives_the_same_gradients() -> None:
    import torch
    by_rank = values(run_ranks(recompute_every_mode, RANKS, timeout=280))
    for rank, answer in enumerate(by_rank):
        plain = answer["none"]
        for mode in ("reentrant", "non-reentrant"):
            checkpointed = answer[mode]
            assert checkpointed["routes"] == plain["routes"] == 3 * 2, (
                f"rank {rank}, {mode}: {checkpointed['routes']} routes with recomputation, "
                f"{plain['routes']} without")
            want, got = plain["gradients"], checkpointed["gradients"]
            assert got.keys() == want.keys()
            for key, grad in want.items():
                assert torch.equal(got[key], grad), (
                    f"rank {rank}, {mode}: {key} differs by "
                    f"{float((got[key] - grad).abs().max())}")


def evaluate_between_steps(rank: int, world: int) -> List[str]:
    """Evaluation passes (model.eval(), torch.no_grad()) between training steps with no extra
    call, and the optimizer hooks attached twice; returns what went wrong, if anything."""
    import torch
    import keel
    import keel.torch as kt

    spec = kt.ffn_expert(HIDDEN, FFN)
    moe = kt.KeelMoE(spec, num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                     config=moe_config("keel"), seed=3)
    layer = moe.layer(0)
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-2)
    moe.attach(optimizer)
    problems = []
    for second in (optimizer, torch.optim.Adam(moe.parameters(), lr=1e-2)):
        try:
            moe.attach(second)
            problems.append("a second attach was accepted")
        except keel.FailedPreconditionError as error:
            if "already attached to Adam" not in str(error):
                problems.append(f"unexpected message: {error}")
    for step in range(4):
        hidden, ids, weights, probe = batch(step, rank)
        layer.train()
        (layer(hidden, ids, weights) * probe).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        layer.eval()
        with torch.no_grad():
            for _ in range(2):
                out = layer(hidden, ids, weights)
                if not torch.isfinite(out).all():
                    problems.append(f"step {step}: an evaluation output is not finite")
    moe.close()
    return problems




def compiled_block(rank: int, world: int) -> Dict[str, Any]:
    """A block of router and KeelMoE layer under torch.compile (aot_eager: dynamo and AOT
    autograd, no code generation), trained 3 steps beside the same block run eagerly on the same
    weights: the outputs and the router's gradients agree."""
    import torch
    import keel.torch as kt

    torch.manual_seed(5)
    router = torch.nn.Linear(HIDDEN, EXPERTS)
    moe = kt.KeelMoE(kt.ffn_expert(HIDDEN, FFN), num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                     config=moe_config("keel"), optimizer="none", seed=3)
    layer = moe.layer(0)
    optimizer = torch.optim.SGD(list(moe.parameters()) + list(router.parameters()), lr=0.05)
    moe.attach(optimizer)

    def block(x: Any) -> Any:
        weights, ids = torch.topk(torch.softmax(router(x), dim=1), TOP_K, dim=1)
        return layer(x, ids, weights)

    compiled = torch.compile(block, backend="aot_eager")
    worst = {"out": 0.0, "router": 0.0}
    for step in range(3):
        hidden, _, _, probe = batch(step, rank)
        eager = block(hidden)
        (eager * probe).sum().backward()
        eager_grads = [p.grad.clone() for p in router.parameters()]
        router.zero_grad(set_to_none=True)
        out = compiled(hidden)
        (out * probe).sum().backward()
        worst["out"] = max(worst["out"], float((out - eager).abs().max()))
        worst["router"] = max(worst["router"], max(float((p.grad - g).abs().max())
                                                   for p, g in zip(router.parameters(),
                                                                   eager_grads)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    moe.close()
    return worst


def two_threads(rank: int, world: int) -> List[str]:
    """One engine driven from two threads on rank 0 while its route waits for the other ranks:
    a second route is refused by name, and stats() waits for the route (without the GIL, which
    the route's collectives need) instead of deadlocking. Returns what went wrong."""
    import threading
    import time
    import torch
    import keel
    import keel.torch as kt

    moe = kt.KeelMoE(kt.ffn_expert(HIDDEN, FFN), num_layers=1, num_experts=EXPERTS, top_k=TOP_K,
                     config=moe_config("static"), seed=3)
    counts = torch.full((EXPERTS,), 3, dtype=torch.int32)
    problems: List[str] = []
    if rank != 0:
        time.sleep(1.0)  # rank 0's route waits for these in its first all-reduce
        moe.engine.route_counts(0, counts)
    else:
        routing = threading.Thread(target=lambda: moe.engine.route_counts(0, counts))
        routing.start()
        time.sleep(0.3)
        try:
            moe.engine.route_counts(0, counts)
            problems.append("a second thread's route was accepted")
        except keel.FailedPreconditionError as error:
            if "runs on another thread" not in str(error):
                problems.append(f"unexpected message: {error}")
        stats = moe.engine.stats()  # waits for the route in progress
        routing.join(timeout=60)
        if routing.is_alive() or stats is None:
            problems.append("the route never finished")
    moe.engine.step_end()
    moe.close()
    return problems


def evaluate_and_compile(rank: int, world: int) -> Dict[str, Any]:
    return {"problems": evaluate_between_steps(rank, world) + two_threads(rank, world),
            "compiled": compiled_block(rank, world)}


def test_evaluation_attach_twice_two_threads_and_a_compiled_block() -> None:
    for rank, answer in enumerate(values(run_ranks(evaluate_and_compile, RANKS, timeout=280))):
        assert answer["problems"] == [], f"rank {rank}: {answer['problems']}"
        worst = answer["compiled"]
        assert worst["out"] < 1e-6 and worst["router"] < 1e-5, f"rank {rank}: {worst}"
