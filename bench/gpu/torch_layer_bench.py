#!/usr/bin/env python3
"""One MoE layer on one GPU, forward + backward, through keel.torch against the same layer in
plain torch: what Keel costs a trainer when the load is balanced.

Size (DeepSeek-V2-Lite's MoE layer): 8,192 tokens, top-6 of 64 experts, hidden 2,048, SwiGLU
experts of FFN 1,408, bfloat16, on a one-rank NCCL group. The routing is uniform (every expert
gets about the same rows) and the placement static, so both layers do the same expert work; the
difference is Keel's routing and bookkeeping.

- *plain*: sort the (token, k) entries by expert, count them per expert (read on the host, as
  the split sizes of torch's all_to_all_single need them), all-to-all (torch's differentiable
  one), each expert on its rows (one split of the received rows), all-to-all back, weighted
  scatter-add into the tokens.
- *keel*: ``KeelMoE(...).layer(0)(hidden, topk_ids, topk_weights)``.

Reported, milliseconds (median of the timed repeats, the GPU synchronised before and after
each piece): forward + backward of each layer, the two interleaved call by call; Keel's own
time: the route alone (count on the GPU, the counts to the host, the engine's quota plan, the
remap by torch operations; it is also inside keel's forward) and the optimizer hooks
(reduce_gradients + step_end, which a training step calls once), also as a share of the plain
layer's forward + backward.

Usage: torch_layer_bench.py [--tokens N] [--experts E] [--top-k K] [--hidden H] [--ffn F]
       [--repeats R] [--warmup W] [--device cuda|cpu] [--json FILE] [--profile FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single as all_to_all  # with autograd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per call (8192)")
    parser.add_argument("--experts", type=int, default=64, help="experts (64)")
    parser.add_argument("--top-k", type=int, default=6, help="choices per token (6)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (2048)")
    parser.add_argument("--ffn", type=int, default=1408, help="expert FFN size (1408)")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per layer (30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first (5)")
    parser.add_argument("--device", default="cuda",
                        help="cuda (NCCL group), or cpu (gloo) to try the script at a small "
                             "size on a machine without a GPU (cuda)")
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--profile", metavar="FILE",
                        help="after the timed calls, profile a few calls of each layer and the "
                             "hooks with torch.profiler and write its tables here (by host "
                             "time and by device time)")
    return parser.parse_args()


class PlainLayer:
    """The MoE layer without Keel, over the same expert parameters (one rank: every expert
    local)."""

    def __init__(self, spec: Any, experts: List[Dict[str, torch.Tensor]], top_k: int) -> None:
        self.spec, self.top_k = spec, top_k
        self.experts = [{n: torch.nn.Parameter(t.clone()) for n, t in e.items()}
                        for e in experts]

    def __call__(self, hidden: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True)[1]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # split sizes
        token = order // self.top_k
        rows = hidden.index_select(0, token)
        received = all_to_all(torch.empty_like(rows), rows, [rows.shape[0]], [rows.shape[0]])
        outputs = [self.spec.forward(expert, part)
                   for expert, n, part in zip(self.experts, counts, received.split(counts)) if n]
        computed = torch.cat(outputs)
        returned = all_to_all(torch.empty_like(computed), computed, [rows.shape[0]],
                              [rows.shape[0]])
        scaled = returned * weights.reshape(-1).index_select(0, order).unsqueeze(1)
        return torch.zeros_like(hidden).index_add(0, token, scaled.to(hidden.dtype))


def profile(path: str, device: torch.device, plain: PlainLayer, layer: Any, moe: Any,
            hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, probe: torch.Tensor,
            clear: Callable[[], None]) -> None:
    """torch.profiler's tables over 5 calls of each layer (Keel's with its hooks), each call in
    a record_function range named after it."""
    from torch.profiler import ProfilerActivity, record_function
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            with record_function("plain layer"):
                (plain(hidden, ids, weights) * probe).sum().backward()
            clear()
            with record_function("keel layer"):
                (layer(hidden, ids, weights) * probe).sum().backward()
            with record_function("keel hooks"):
                moe.reduce_gradients()
                moe.step_end()
            clear()
        if device.type == "cuda":
            torch.cuda.synchronize()
    averages = prof.key_averages()
    with open(path, "w") as out:
        out.write("# by host time (self)\n")
        out.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        if device.type == "cuda":
            out.write("# by device time (self)\n")
            out.write(averages.table(sort_by="self_device_time_total", row_limit=40) + "\n")


def main() -> int:
    args = parse_args()
    if args.device not in ("cuda", "cpu"):
        print(f"torch_layer_bench: --device {args.device} is not cuda or cpu", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("torch_layer_bench: torch sees no CUDA device", file=sys.stderr)
        return 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    import keel
    import keel.torch as kt

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    spec = kt.ffn_expert(args.hidden, args.ffn, activation="swiglu")
    config = {"topology": {"num_nodes": 1, "gpus_per_node": 1},
              "slots": {"persistent_per_rank": args.experts, "transient_per_rank": 0},
              "policy": {"name": "static"}, "migration": {"transport": "ucx"}}
    moe = kt.KeelMoE(spec, num_layers=1, num_experts=args.experts, top_k=args.top_k,
                     config=config, device=device, dtype=torch.bfloat16)
    layer = moe.layer(0)
    plain = PlainLayer(spec, moe.gather_experts(0), args.top_k)

    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16,
                         generator=generator).requires_grad_(True)
    # Uniform routing: each token's k distinct experts, uniformly at random.
    scores = torch.rand(args.tokens, args.experts, device=device, generator=generator)
    ids = scores.topk(args.top_k, dim=1).indices
    weights = torch.softmax(torch.randn(args.tokens, args.top_k, device=device,
                                        generator=generator), dim=1).requires_grad_(True)
    probe = torch.randn_like(hidden)

    def clear() -> None:
        hidden.grad = weights.grad = None
        for expert in plain.experts:
            for p in expert.values():
                p.grad = None

    def synchronized() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    samples: Dict[str, List[float]] = {"plain": [], "keel": [], "route": [], "hooks": []}
    for repeat in range(args.warmup + args.repeats):
        keep = repeat >= args.warmup
        started = synchronized()
        (plain(hidden, ids, weights) * probe).sum().backward()
        ended = synchronized()
        clear()
        # Keel's layer, then its optimizer hooks as the optimizer would call them.
        started_keel = synchronized()
        (layer(hidden, ids, weights) * probe).sum().backward()
        ended_keel = synchronized()
        moe.reduce_gradients()
        moe.step_end()
        ended_hooks = synchronized()
        clear()
        # The route alone: count, counts to the host, quota plan, remap.
        started_route = synchronized()
        layer._route(ids)
        ended_route = synchronized()
        moe.end_forward_pass()
        if keep:
            samples["plain"].append(ended - started)
            samples["keel"].append(ended_keel - started_keel)
            samples["hooks"].append(ended_hooks - ended_keel)
            samples["route"].append(ended_route - started_route)

    if args.profile:
        profile(args.profile, device, plain, layer, moe, hidden, ids, weights, probe, clear)

    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    results: Dict[str, Any] = {"device": name,
                               "torch": torch.__version__, "keel": keel.__version__,
                               "size": {k: getattr(args, k) for k in
                                        ("tokens", "experts", "top_k", "hidden", "ffn")},
                               "repeats": args.repeats}
    median = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    results["median_ms"] = median
    results["spread_ms"] = {name: [min(s) * 1e3, max(s) * 1e3] for name, s in samples.items()}
    own = median["route"] + median["hooks"]
    results["keel_own_ms"] = own
    results["keel_own_share"] = own / median["plain"]
    results["keel_over_plain"] = median["keel"] / median["plain"]
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    moe.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
