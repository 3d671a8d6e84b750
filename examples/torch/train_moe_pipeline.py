#!/usr/bin/env python3
"""Trains train_moe_lm.py's character-level MoE transformer as a pipeline: --pipeline-stages
stages of its blocks (the first with the embeddings, the last with the head and the loss), each
stage on --ranks / stages expert-parallel ranks with a KeelMoE (one engine) of its own over the
stage's group, and --micro-batches per optimizer step in a one-forward-one-backward (1F1B)
schedule.

Ranks are numbered stage by stage: with 4 processes and 2 stages, ranks 0 and 1 are stage 0 and
ranks 2 and 3 stage 1; rank r of stage 0 hands its micro-batches' hidden states to rank r + 2
and gets their gradients back (torch.distributed isend/irecv between the pair). A stage's ranks
are also its data-parallel ranks: each draws the batches its rank of train_moe_lm.py would, and
a stage's dense gradients are averaged over them. Every stage starts from the weights of the
unpipelined model (the whole model is built from the same seed on every rank and each stage
keeps its part; its experts are those of the global layers it holds), so the pipeline trains
what train_moe_lm.py's gradient accumulation over the same micro-batches on --ranks / stages
ranks trains (tests/python/test_pipeline_example.py compares the losses).

The step is reported the way separate GPUs would take it. Each micro-batch's forward and
backward on a stage gets a time from the stage's ranks (per layer the slower rank's expert and
route + all-to-all time, the slower rank's other compute and its hand-over to the next stage,
in CPU time as train_moe_lm.py measures), and the 1F1B schedule is replayed over these times:
an operation starts when its stage is free and the operation it needs from the neighbouring
stage has ended. The step is the replay's end, per stage after its optimizer phase, plus exposed
migration waiting; the bubble is what it adds to the slowest stage's own work.

Run it (4 processes on this machine, static and keel in turn step by step, a comparison table):

    python examples/torch/train_moe_pipeline.py --report out/torch-pipeline.json

or under torchrun, one mode:

    torchrun --nproc_per_node 4 examples/torch/train_moe_pipeline.py --policy keel

The schedule is the example's own, over torch.distributed's isend/irecv, rather than
torch.distributed.pipelining's Schedule1F1B (whose sends and receives gloo would carry too):
its schedules run every micro-batch's forward and backward inside ``step()``, where the
step-time model above cannot time each operation per stage, and its loss is taken on the last
stage's output only, so the balancing loss of the first stage's routers would have to travel
down the pipeline as an extra activation. Here each stage backpropagates its own.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_moe_lm as lm  # noqa: E402  (sets one BLAS thread per rank before torch loads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import keel.torch as kt  # noqa: E402

# One operation of a stage's schedule: ("F" or "B", micro-batch).
Operation = Tuple[str, int]

STEP_TIME_MODEL = (
    "1F1B replay: each micro-batch's forward and backward per stage takes the stage's time "
    "(per layer the slower rank's expert and route + all-to-all CPU time, plus the slower "
    "rank's other compute and hand-over); an operation starts when its stage is free and the "
    "neighbouring stage's operation it needs has ended; the step ends when the last stage's "
    "optimizer phase (slowest rank) does, plus exposed migration")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    # train_moe_lm.py's flags, some with a pipeline's meaning ("resolve": these replace them).
    p = lm.make_parser(
        description="Train train_moe_lm.py's character-level MoE transformer as a pipeline "
                    "(stages x expert-parallel ranks, micro-batches in a 1F1B schedule), once "
                    "per placement policy, and compare the modes.",
        conflict_handler="resolve")
    p.add_argument("--ranks", type=int, default=4,
                   help="processes to start when not launched by torchrun: --pipeline-stages "
                        "times the expert-parallel ranks of a stage")
    p.add_argument("--pipeline-stages", type=int, default=2,
                   help="pipeline stages: the first holds the embeddings and the first blocks, "
                        "the last the last blocks, the head and the loss")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="micro-batches per optimizer step, in a 1F1B schedule (at least "
                        "--pipeline-stages)")
    p.add_argument("--batch", type=int, default=16,
                   help="sequences per data-parallel rank (a stage's expert-parallel rank) per "
                        "step, split into --micro-batches")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="held-out sequences per data-parallel rank for the final held-out loss")
    p.add_argument("--config", default="",
                   help="Keel config (YAML) for every stage's engine in the keel modes, its "
                        "topology one stage's ranks; default: one node of a stage's ranks "
                        "sized to this model on a CPU, migration over UCX")
    p.add_argument("--condense", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--save", default="", help=argparse.SUPPRESS)
    p.add_argument("--resume", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.condense:
        p.error("--condense: token condensation is train_moe_lm.py's comparison, not the "
                "pipeline's")
    for name in ("save", "resume"):
        if getattr(args, name):
            p.error(f"--{name}: checkpoints are train_moe_lm.py's; the pipeline example does not "
                    f"save or load them")
    lm.check_args(p, args)
    for name in ("pipeline_stages", "micro_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    stages = args.pipeline_stages
    launched = "WORLD_SIZE" in os.environ
    processes = int(os.environ["WORLD_SIZE"]) if launched else args.ranks
    if processes % stages:
        p.error(f"--pipeline-stages {stages} does not divide the {processes} processes "
                f"({'torchrun' + chr(39) + 's world size' if launched else '--ranks'}): every "
                f"stage needs the same number of expert-parallel ranks")
    if args.micro_batches < stages:
        p.error(f"--micro-batches {args.micro_batches} is fewer than --pipeline-stages "
                f"{stages}: a 1F1B schedule needs a micro-batch in flight per stage")
    if args.layers < stages:
        p.error(f"--layers {args.layers} is fewer than --pipeline-stages {stages}: every "
                f"stage needs a block")
    return args


# --- the schedule and its step time -------------------------------------------------------------
def one_f_one_b(stage: int, stages: int, micro_batches: int) -> List[Operation]:
    """Stage ``stage``'s operations in order: warm-up forwards (one fewer per later stage), then
    one forward and one backward in turn, then the cool-down backwards. Every stage holds at
    most ``stages - stage`` micro-batches' activations."""
    warmup = min(stages - stage - 1, micro_batches)
    operations = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        operations += [("F", warmup + i), ("B", i)]
    return operations + [("B", i) for i in range(micro_batches - warmup, micro_batches)]


def replay(schedules: Sequence[Sequence[Operation]], duration: Dict[Tuple[int, str, int], float],
           finish: Sequence[float]) -> Tuple[float, List[Tuple[int, str, int]], int]:
    """The step of ``schedules`` (one per stage) on separate devices: operation (stage, kind,
    micro-batch) takes ``duration[...]`` seconds and starts when its stage has ended the one
    before it and, for a forward, the previous stage has ended the same micro-batch's forward
    (a backward: the next stage its backward); stage s then takes ``finish[s]`` more (its
    optimizer phase). Returns the step's seconds, the critical path (operations end to end
    without a gap, first to last) and the stage that ends last."""
    stages = len(schedules)
    end: Dict[Tuple[int, str, int], float] = {}
    cause: Dict[Tuple[int, str, int], Optional[Tuple[int, str, int]]] = {}
    position, clock = [0] * stages, [0.0] * stages
    last: List[Optional[Tuple[int, str, int]]] = [None] * stages
    left = sum(len(s) for s in schedules)
    while left:
        moved = False
        for s in range(stages):
            while position[s] < len(schedules[s]):
                kind, i = schedules[s][position[s]]
                needs = ((s - 1, "F", i) if kind == "F" and s > 0 else
                         (s + 1, "B", i) if kind == "B" and s + 1 < stages else None)
                if needs is not None and needs not in end:
                    break
                operation = (s, kind, i)
                start, cause[operation] = clock[s], last[s]
                if needs is not None and end[needs] > start:
                    start, cause[operation] = end[needs], needs
                end[operation] = clock[s] = start + duration[operation]
                last[s] = operation
                position[s] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError(f"the schedules deadlock: {schedules}")
    ending = max(range(stages), key=lambda s: clock[s] + finish[s])
    path: List[Tuple[int, str, int]] = []
    operation = last[ending]
    while operation is not None:
        path.append(operation)
        operation = cause[operation]
    return clock[ending] + finish[ending], path[::-1], ending


# --- the stages ---------------------------------------------------------------------------------
class Layout:
    """Where this rank sits: its stage and member (data-parallel index), the stage's group and
    layers, the paired ranks of the stages next to it (-1: none), every stage's layers
    (``split``: stage s holds [split[s], split[s + 1])) and schedule. Creating it is collective
    over the world (one group per stage)."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace) -> None:
        stages = args.pipeline_stages
        self.stages, self.ep = stages, world // stages
        self.stage, self.member = divmod(rank, self.ep)
        groups = [dist.new_group(list(range(s * self.ep, (s + 1) * self.ep)))
                  for s in range(stages)]
        self.group = groups[self.stage]
        self.split = [s * args.layers // stages for s in range(stages + 1)]
        self.layers = range(self.split[self.stage], self.split[self.stage + 1])
        self.first, self.last = self.stage == 0, self.stage == stages - 1
        self.previous = rank - self.ep if not self.first else -1
        self.next = rank + self.ep if not self.last else -1
        # The most layers a stage holds: the width of a layer field in a step's measurements.
        self.widest = max(b - a for a, b in zip(self.split, self.split[1:]))
        self.schedules = [one_f_one_b(s, stages, args.micro_batches) for s in range(stages)]
        self.schedule = self.schedules[self.stage]


class StageModel(torch.nn.Module):
    """One stage's part of train_moe_lm.CharMoE: the embeddings on the first stage, the stage's
    blocks, the final norm and the head on the last. ``forward(x) -> (y, aux)``: x is ``[b, s]``
    int64 character ids on the first stage, else ``[b, s, d_model]`` hidden states; y is the
    logits on the last stage, else the hidden states; aux the sum of the blocks' balancing
    losses."""

    def __init__(self, whole: lm.CharMoE, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = whole.embed if first else None
        self.position = whole.position if first else None
        self.blocks = torch.nn.ModuleList(whole.blocks[l] for l in layers)
        self.norm = whole.norm if last else None
        self.head = whole.head if last else None
        self.register_buffer("mask", whole.mask)

    def forward(self, x: torch.Tensor) -> tuple:
        if self.embed is not None:
            x = self.embed(x) + self.position(torch.arange(x.shape[1]))
        mask = self.mask[:x.shape[1], :x.shape[1]]
        aux = x.new_zeros(())
        for block in self.blocks:
            x, layer_aux = block(x, mask)
            aux = aux + layer_aux
        if self.head is not None:
            x = self.head(self.norm(x))
        return x, aux


class _StageLayers:
    """Stands in for the whole model's KeelMoE while train_moe_lm.CharMoE is built: this stage's
    layers are its KeelMoE's, the others' placeholders (dropped with their blocks)."""

    def __init__(self, moe: kt.KeelMoE, layers: range) -> None:
        self.moe, self.layers = moe, layers

    def layer(self, l: int) -> torch.nn.Module:
        return self.moe.layer(l - self.layers.start) if l in self.layers else torch.nn.Identity()


def global_layer_init(spec: kt.ExpertSpec, seed: int, first_layer: int) -> Any:
    """``init_expert`` for a stage whose local layer 0 is global layer ``first_layer``: the
    initialization KeelMoE.initial_expert gives the unpipelined model's global layer
    (tests/python/test_pipeline_example.py compares every stage's experts with it)."""

    def init(layer: int, expert: int) -> Dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(
            (seed * 1_000_003 + (first_layer + layer) * 65_537 + expert) % (2 ** 63))
        return spec.init(generator)

    return init


class PipelineMode:
    """One policy's stage (model part, engine, optimizer) on this rank, its 1F1B step, and what
    the steps measured."""

    KEYS = ("parallel", "expert", "communication", "dense", "transfer", "control", "exposed",
            "dispatch", "bubble", "slowest_stage", "balanced", "imbalance", "loss", "epoch")

    def __init__(self, name: str, args: argparse.Namespace, layout: Layout, vocab: int) -> None:
        torch.manual_seed(args.seed)  # the whole model's dense weights, as train_moe_lm's
        spec = kt.ffn_expert(args.d_model, args.ffn)
        self.policy, self.args, self.layout = name, args, layout
        self.moe = kt.KeelMoE(spec, num_layers=len(layout.layers), num_experts=args.experts,
                              top_k=args.top_k, group=layout.group,
                              config=lm.keel_config(args, layout.ep, name), seed=args.seed,
                              init_expert=global_layer_init(spec, args.seed, layout.layers.start))
        whole = lm.CharMoE(args, vocab, _StageLayers(self.moe, layout.layers))
        self.model = StageModel(whole, layout.layers, layout.first, layout.last)
        self.dense = lm.dense_parameters(self.model, self.moe)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.moe.attach(self.optimizer)
        self.per_step: Dict[str, List[Any]] = {k: [] for k in self.KEYS}
        self.busy: List[List[float]] = []  # per step: each stage's operations and optimizer
        self.layer_imbalance = [0.0] * args.layers
        self.exposed_before = 0.0
        self.wall = 0.0
        self.timeout = datetime.timedelta(seconds=self.moe.collective_timeout)
        # Within a step: micro-batch -> (input, output, aux term) until its backward, the sends
        # in flight, the last stage's losses, the current operation's hand-over time (process,
        # thread).
        self.pending: Dict[int, Any] = {}
        self.sends: List[Any] = []
        self.losses: List[float] = []
        self.transfer = [0.0, 0.0]

    # --- hand-over between stages ---------------------------------------------------------------
    def _receive(self, shape: Sequence[int], peer: int, tag: int) -> torch.Tensor:
        started, started_thread = time.process_time(), time.thread_time()
        tensor = torch.empty(tuple(shape))
        dist.irecv(tensor, src=peer, tag=tag).wait(self.timeout)
        self.transfer[0] += time.process_time() - started
        self.transfer[1] += time.thread_time() - started_thread
        return tensor

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        started, started_thread = time.process_time(), time.thread_time()
        tensor = tensor.contiguous()
        self.sends.append((dist.isend(tensor, dst=peer, tag=tag), tensor))
        self.transfer[0] += time.process_time() - started
        self.transfer[1] += time.thread_time() - started_thread

    # --- one step -------------------------------------------------------------------------------
    def _forward(self, i: int, part: torch.Tensor) -> None:
        args, layout = self.args, self.layout
        M, L = args.micro_batches, args.layers
        if layout.first:
            x = part[:, :-1]
        else:
            x = self._receive((part.shape[0], args.seq_len, args.d_model), layout.previous, i)
            x.requires_grad_()
        y, aux = self.model(x)
        if layout.last:
            loss = F.cross_entropy(y.reshape(-1, y.shape[-1]), part[:, 1:].reshape(-1))
            self.losses.append(loss.item())
            # train_moe_lm's objective, its aux term over every layer of every stage (each stage
            # adds its own layers'), per micro-batch 1/M of it: the gradients of the mean.
            self.pending[i] = (x, (loss + args.aux_loss * (aux / L)) / M, None)
        else:
            self._send(y.detach(), layout.next, i)
            self.pending[i] = (x, y, args.aux_loss * (aux / L) / M)

    def _backward(self, i: int) -> None:
        layout, M = self.layout, self.args.micro_batches
        x, y, aux_term = self.pending.pop(i)
        if layout.last:
            y.backward()
        else:
            gradient = self._receive(y.shape, layout.next, M + i)
            torch.autograd.backward([y, aux_term], [gradient, None])
        if not layout.first:
            self._send(x.grad, layout.previous, M + i)

    def step(self, batch: torch.Tensor) -> List[float]:
        """Trains one step on ``batch`` (this data-parallel rank's [batch, seq_len + 1]) and
        returns this rank's measurements (:meth:`record` reads every rank's)."""
        args, layout, moe = self.args, self.layout, self.moe
        started_wall = time.monotonic()
        moe.times = times = kt.StepTimes(len(layout.layers))
        parts = batch.split(args.batch // args.micro_batches)
        self.sends, self.losses = [], []
        phases: Dict[Operation, List[float]] = {}
        for kind, i in layout.schedule:
            before = (list(times.expert), list(times.communication), times.route_thread,
                      times.exchange_thread, times.dispatch)
            self.transfer = [0.0, 0.0]
            thread_started = time.thread_time()
            if kind == "F":
                self._forward(i, parts[i])
            else:
                self._backward(i)
            thread = time.thread_time() - thread_started
            expert = [a - b for a, b in zip(times.expert, before[0])]
            communication = [a - b for a, b in zip(times.communication, before[1])]
            dense = (thread - sum(expert) - (times.route_thread - before[2])
                     - (times.exchange_thread - before[3]) - self.transfer[1])
            phases[(kind, i)] = expert + communication + [dense, self.transfer[0],
                                                          times.dispatch - before[4]]
        for work, _ in self.sends:
            work.wait(self.timeout)
        control_started = time.process_time()
        # A stage's dense gradients are averaged over its data-parallel ranks (DDP's job); the
        # experts' are Keel's, folded into their homes by the hook inside optimizer.step().
        lm.average_gradients(self.dense, layout.ep, layout.group)
        self.optimizer.step()
        self.optimizer.zero_grad()
        control = time.process_time() - control_started
        self.wall += time.monotonic() - started_wall
        moe.times = None
        stats = moe.stats()
        exposed = stats["exposed_migration_seconds"] - self.exposed_before
        self.exposed_before = stats["exposed_migration_seconds"]
        # Every rank's row has the same fields: layer fields padded to the widest stage.
        n = len(layout.layers)
        padding = [0.0] * (layout.widest - n)
        row = []
        for kind in ("F", "B"):
            for i in range(args.micro_batches):
                phase = phases[(kind, i)]
                row += phase[:n] + padding + phase[n:2 * n] + padding + phase[2 * n:]
        rows = times.rows + padding
        loss = sum(self.losses) / len(self.losses) if self.losses else 0.0
        return row + [control, exposed, float(stats["epoch"]), loss] + [float(r) for r in rows]

    def record(self, table: torch.Tensor) -> None:
        """Takes the step's measurements of every rank (``table``: [world, row] float64, rank
        r's :meth:`step` row in row r) and records the step as separate GPUs would take it."""
        args, layout = self.args, self.layout
        M, W, ep = args.micro_batches, layout.widest, layout.ep
        width = 2 * W + 3
        phases = table[:, :2 * M * width].reshape(-1, 2 * M, width)
        tail = table[:, 2 * M * width:]
        duration: Dict[Tuple[int, str, int], float] = {}
        # The same with every operation's experts at its stage's mean over ranks: perfect
        # balance at no cost.
        balanced: Dict[Tuple[int, str, int], float] = {}
        parts: Dict[Tuple[int, str, int], List[float]] = {}
        finish, busy = [], []
        imbalances: List[float] = []
        for s in range(layout.stages):
            mine = slice(s * ep, (s + 1) * ep)
            n = layout.split[s + 1] - layout.split[s]
            # Per layer the stage's slower rank, as in train_moe_lm's parallel step.
            slowest = phases[mine].max(dim=0).values  # [2M, width]
            even = phases[mine].mean(dim=0)
            for index, (kind, i) in enumerate([("F", i) for i in range(M)]
                                              + [("B", i) for i in range(M)]):
                expert = slowest[index, :n].sum().item()
                communication = slowest[index, W:W + n].sum().item()
                dense, transfer, dispatch = slowest[index, 2 * W:].tolist()
                parts[(s, kind, i)] = [expert, communication, dense, transfer, dispatch]
                duration[(s, kind, i)] = expert + communication + dense + transfer
                balanced[(s, kind, i)] = (duration[(s, kind, i)] - expert
                                          + even[index, :n].sum().item())
            control, exposed = tail[mine, 0].max().item(), tail[mine, 1].max().item()
            finish.append(control + exposed)
            busy.append(sum(duration[(s, k, i)] for k, i in layout.schedules[s]) + control
                        + exposed)
            rows = tail[mine, 4:4 + n]  # [ep, n] rows each rank's experts computed
            for l, value in enumerate((rows.max(dim=0).values * ep
                                       / rows.sum(dim=0).clamp(min=1)).tolist()):
                imbalances.append(value)
                self.layer_imbalance[layout.split[s] + l] += value / args.steps
        step, path, ending = replay(layout.schedules, duration, finish)
        balanced_step, _, _ = replay(layout.schedules, balanced, finish)
        on_path = [sum(parts[op][k] for op in path) for k in range(5)]
        last_stage = slice((layout.stages - 1) * ep, layout.stages * ep)
        ending_ranks = slice(ending * ep, (ending + 1) * ep)
        for key, value in (("parallel", step), ("expert", on_path[0]),
                           ("communication", on_path[1]), ("dense", on_path[2]),
                           ("transfer", on_path[3]), ("dispatch", on_path[4]),
                           ("control", tail[ending_ranks, 0].max().item()),
                           ("exposed", tail[ending_ranks, 1].max().item()),
                           ("bubble", step - max(busy)), ("slowest_stage", max(busy)),
                           ("balanced", balanced_step),
                           ("imbalance", sum(imbalances) / len(imbalances)),
                           ("loss", tail[last_stage, 3].mean().item()),
                           ("epoch", [int(tail[s * ep, 2].item())
                                      for s in range(layout.stages)])):
            self.per_step[key].append(value)
        self.busy.append(busy)
        self.rank_rows = tail[:, 4:4 + W].sum(dim=1).tolist()

    def report(self, heldout: float, stage_stats: List[Dict[str, Any]]) -> Dict[str, Any]:
        per_step, args, layout = self.per_step, self.args, self.layout
        mean = lambda key: sum(per_step[key]) / len(per_step[key])  # noqa: E731
        steps = len(self.busy)
        return {
            "policy": self.policy,
            # The critical path's parts (expert, communication, dense, control, exposed
            # migration seconds): they sum to the parallel step.
            **lm.step_report(per_step, self.layer_imbalance),
            "dispatch_seconds": mean("dispatch"),
            "python_overhead_fraction": mean("dispatch") / mean("parallel"),
            "per_step": {k: per_step[k] for k in ("expert", "communication", "dense", "control",
                                                  "transfer", "bubble")},
            "epochs": sum(s["epochs_committed"] for s in stage_stats),
            "epochs_aborted": sum(s["epochs_aborted"] for s in stage_stats),
            "epoch_per_step": per_step["epoch"],
            "bytes_moved": sum(s["bytes_moved"] for s in stage_stats),
            "heldout_loss": heldout,
            "tokens_per_second": args.batch * args.seq_len * layout.ep * args.steps / self.wall,
            "wall_seconds": self.wall,
            "pipeline": {
                "stages": layout.stages,
                "expert_parallel_ranks": layout.ep,
                "micro_batches": args.micro_batches,
                "layers": [[layout.split[s], layout.split[s + 1]] for s in range(layout.stages)],
                "schedule": [" ".join(f"{k}{i}" for k, i in schedule)
                             for schedule in layout.schedules],
                "step_time_model": STEP_TIME_MODEL,
                "transfer_seconds": mean("transfer"),
                "bubble_seconds": mean("bubble"),
                "bubble_fraction": mean("bubble") / mean("parallel"),
                "slowest_stage_seconds": mean("slowest_stage"),
                # The step replayed with every operation's expert time at its stage's mean over
                # ranks: what perfect balance at no cost would give this mode's step.
                "balanced_step_seconds": mean("balanced"),
                "stage_busy_seconds": [sum(b[s] for b in self.busy) / steps
                                       for s in range(layout.stages)],
                "stage_epochs": [s["epochs_committed"] for s in stage_stats],
                "stage_bytes_moved": [s["bytes_moved"] for s in stage_stats],
            },
        }


# --- one rank's run -----------------------------------------------------------------------------
def train(rank: int, world: int, args: argparse.Namespace,
          text: str) -> Optional[Dict[str, Dict[str, Any]]]:
    """Trains every mode of args.policies on this rank's stage, step by step in turn (as
    train_moe_lm.train does); returns the modes' reports on rank 0."""
    torch.set_num_threads(1)  # one GPU per rank: its time is this thread's time
    layout = Layout(rank, world, args)
    corpus = lm.Corpus(text)
    modes = [PipelineMode(policy, args, layout, len(corpus.chars)) for policy in args.policies]
    # The batches train_moe_lm's rank `member` draws, on every stage of the pipeline.
    data = torch.Generator().manual_seed(args.seed * 7919 + layout.member)
    terminal = sys.stderr.isatty()
    for step in range(args.steps):
        batch = corpus.batch(corpus.train, args.batch, args.seq_len, data)
        for mode in modes:
            row = torch.tensor(mode.step(batch), dtype=torch.float64)
            table = torch.zeros(world, row.numel(), dtype=torch.float64)
            table[rank] = row
            dist.all_reduce(table)
            mode.record(table)
        last = step + 1 == args.steps
        if rank == 0 and not args.quiet and (terminal or (step + 1) % 10 == 0 or last):
            print(f"{chr(13) if terminal else ''}step {step + 1:4d}/{args.steps}  loss "
                  f"{modes[0].per_step['loss'][-1]:.4f}  "
                  + "  ".join(progress(m, layout) for m in modes),
                  end="" if terminal and not last else "\n", file=sys.stderr, flush=True)
    heldout = {mode.policy: evaluate(mode, corpus, args, layout) for mode in modes}
    reports = {}
    for mode in modes:
        everyone: List[Any] = [None] * world
        dist.all_gather_object(everyone, mode.moe.stats())
        stage_stats = [everyone[s * layout.ep] for s in range(layout.stages)]
        reports[mode.policy] = mode.report(heldout[mode.policy], stage_stats)
    for mode in modes:
        mode.moe.close()
    return reports if rank == 0 else None


def progress(mode: PipelineMode, layout: Layout) -> str:
    """The mode's last step: its time, bubble, imbalance, the rows per rank (stage by stage) and
    each stage's epoch."""
    rows = mode.rank_rows
    bars = "|".join(
        "".join("▁▂▃▄▅▆▇█"[min(7, round(7 * r / max(1.0, max(rows))))]
                for r in rows[s * layout.ep:(s + 1) * layout.ep])
        for s in range(layout.stages))
    step = mode.per_step
    return (f"{mode.policy} {step['parallel'][-1] * 1e3:6.1f} ms bubble "
            f"{step['bubble'][-1] / step['parallel'][-1] * 100:4.1f}% imb "
            f"{step['imbalance'][-1]:.3f} {bars} ep {'/'.join(map(str, step['epoch'][-1]))}")


@torch.no_grad()
def evaluate(mode: PipelineMode, corpus: lm.Corpus, args: argparse.Namespace,
             layout: Layout) -> float:
    """train_moe_lm.evaluate through the pipeline: the same held-out sequences per data-parallel
    rank, in one forward pass of every stage."""
    generator = torch.Generator().manual_seed(args.seed * 104729 + layout.member)
    batch = corpus.batch(corpus.heldout, args.eval_batches, args.seq_len, generator)
    mode.transfer, mode.sends = [0.0, 0.0], []
    x = (batch[:, :-1] if layout.first else
         mode._receive((args.eval_batches, args.seq_len, args.d_model), layout.previous, 0))
    y, _ = mode.model(x)
    mode.moe.end_forward_pass()
    if not layout.last:
        mode._send(y, layout.next, 0)
        mode.sends[0][0].wait(mode.timeout)
    total = torch.zeros(2, dtype=torch.float64)
    if layout.last:
        loss = F.cross_entropy(y.reshape(-1, y.shape[-1]), batch[:, 1:].reshape(-1),
                               reduction="sum")
        total += torch.tensor([loss.item(), float(batch[:, 1:].numel())], dtype=torch.float64)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


# --- launching ----------------------------------------------------------------------------------
def summarize(modes: Dict[str, Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    """train_moe_lm's table and comparison (its times are the critical path's parts), the
    no-cost bound replayed, then each mode's pipeline figures."""
    comparison = lm.summarize(modes, args)
    if "static" in modes and "keel" in modes:
        static = modes["static"]
        # train_moe_lm's bound divides the critical path's expert time by the step's mean
        # imbalance; the replay balances each operation, whose imbalance is a micro-batch's.
        bound = (static["pipeline"]["balanced_step_seconds"]
                 / static["parallel_step_seconds"]["mean"])
        gap = comparison["parallel_step_ratio"]["value"] - bound
        comparison["replayed_no_cost_bound"] = {"value": bound, "gap": gap}
        print(f"no-cost bound, replayed:     {bound:.3f} (static's schedule replayed with each "
              f"operation's experts at its stage's mean over ranks; keel's gap to it: "
              f"{gap:.3f})")
    print()
    for name, m in modes.items():
        pipeline = m["pipeline"]
        print(f"{name}: bubble {pipeline['bubble_seconds'] * 1e3:.1f} ms "
              f"({pipeline['bubble_fraction'] * 100:.1f}% of the step), slowest stage "
              f"{pipeline['slowest_stage_seconds'] * 1e3:.1f} ms, stages busy "
              + ", ".join(f"{b * 1e3:.1f}" for b in pipeline["stage_busy_seconds"])
              + f" ms, hand-over on the critical path {pipeline['transfer_seconds'] * 1e3:.1f} ms")
    return comparison


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    text = lm.load_text_for(args, "train_moe_pipeline")
    settings = {k: v for k, v in vars(args).items()
                if k not in ("policy", "report", "quiet", "condense")}
    settings["blas"] = lm.blas_library()
    settings["step_time_model"] = STEP_TIME_MODEL
    if settings["blas"] and not re.search(r"openblas|mkl|blis", settings["blas"]):
        print(f"train_moe_pipeline: torch runs on the reference BLAS ({settings['blas']}), "
              f"about 16 times slower than OpenBLAS (see train_moe_lm.py)", file=sys.stderr)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        for key, value in lm.LOOPBACK.items():
            os.environ.setdefault(key, value)
        dist.init_process_group("gloo")
        modes = train(dist.get_rank(), dist.get_world_size(), args, text)
        dist.destroy_process_group()
        if modes is None:
            return 0
    else:
        if not args.quiet:
            ep = args.ranks // args.pipeline_stages
            print(f"train_moe_pipeline: {args.pipeline_stages} stages x {ep} expert-parallel "
                  f"ranks, {args.micro_batches} micro-batches of "
                  f"{args.batch // args.micro_batches} x {args.seq_len} characters per "
                  f"data-parallel rank (1F1B), {args.layers} layers x {args.experts} experts "
                  f"top-{args.top_k}, d_model {args.d_model}, FFN {args.ffn}, {args.steps} "
                  f"steps, aux loss {args.aux_loss}, modes {', '.join(args.policies)} (in turn, "
                  f"step by step); text: {len(text)} characters", file=sys.stderr)
        modes = lm.run_ranks(args, text, train)
    comparison = summarize(modes, args)
    if args.report:
        lm.write_report(args.report, {"example": "train_moe_pipeline", "settings": settings,
                                      "modes": modes, "comparison": comparison})
    return 0


if __name__ == "__main__":
    sys.exit(main())
