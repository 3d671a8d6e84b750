#!/usr/bin/env python3
"""Trains a small character-level MoE transformer on the King James Bible through keel.torch:
the Python counterpart of `keel demo`.

Every rank runs the same model on its own batches; each MoE layer's experts live in Keel's slots
and its tokens go through keel.torch's dispatcher (route, all-to-all, local experts, combine),
the router is trained with the usual auxiliary load-balancing loss, and Adam runs on the homes.
Each policy (static and keel by default) trains its own copy of the model from the same seed on
the same batches; the ranks step the modes in turn, step by step, so that a shared machine's
drifting speed weighs on every mode alike. Each mode's report gives tokens per second,
imbalance, the parallel step (the step separate GPUs would take: per layer the slowest rank's
expert and communication time, plus the slowest rank's other compute and control), epochs,
bytes moved, the loss curve and the held-out loss.

Run it (4 ranks as processes on this machine, both policies, a comparison table at the end):

    python examples/torch/train_moe_lm.py --report out/torch-demo.json

or under torchrun, one mode:

    torchrun --nproc_per_node 4 examples/torch/train_moe_lm.py --policy keel --report keel.json

The text comes from Debian's bible-kjv package (`bible -f Gen1:1-Rev22:21`); --text FILE trains
on any other UTF-8 text instead. Needs torch 2.x and the keel package (`pip install .`, or
`scripts/dev torch-demo`, which runs it from the build with the project's .venv).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

# One BLAS thread per rank, as one GPU per rank: a rank's expert time is its thread's time.
# (torch.set_num_threads governs torch's own pool and MKL, not a system OpenBLAS's threads.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.nn.functional as F

import keel
import keel.torch as kt

# Keel's migration transport and gloo stay on loopback unless the caller says otherwise.
LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo"}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def make_parser(**settings: Any) -> argparse.ArgumentParser:
    """The example's flags; ``settings`` go to ArgumentParser (train_moe_pipeline.py adds its
    own flags to these)."""
    settings.setdefault("description",
                        "Train a character-level MoE transformer on the KJV Bible through Keel, "
                        "once per placement policy, and compare the modes.")
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                **settings)
    p.add_argument("--ranks", type=int, default=4,
                   help="processes to start when not launched by torchrun")
    p.add_argument("--policy", action="append", choices=keel.policy_names(),
                   help="placement policy; repeat to compare several, trained in turn step by "
                        "step (default: static and keel)")
    p.add_argument("--steps", type=int, default=120, help="training steps per mode")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks, each with an MoE")
    p.add_argument("--experts", type=int, default=16, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--d-model", type=int, default=128, help="hidden size")
    p.add_argument("--ffn", type=int, default=2048, help="expert FFN size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="split each step's batch into this many micro-batches, a forward and a "
                        "backward each, gradients accumulated before one optimizer step; "
                        "divides --batch")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--aux-loss", type=float, default=0.01,
                   help="coefficient of the load-balancing loss (Switch/Mixtral); 0 turns it off")
    add_data_flags(p)
    p.add_argument("--report", default="", help="write the JSON report here")
    p.add_argument("--save", default="", metavar="DIR",
                   help="after training, save each mode's checkpoint (torch.distributed."
                        "checkpoint: the model with its experts by logical id, the experts' and "
                        "the dense Adam state) into DIR/<mode>; the report gives the time and "
                        "bytes")
    p.add_argument("--resume", default="", metavar="DIR",
                   help="before training, load each mode's checkpoint from DIR/<mode> (saved "
                        "with --save, by any number of ranks); the report gives the time")
    p.add_argument("--quiet", action="store_true", help="no per-step progress")
    p.add_argument("--condense", type=float, default=0.0, metavar="THRESHOLD",
                   help="Luffy's token condensation (docs/luffy.md): compare keel without it "
                        "(mode keel) and with it (mode keel+condense), rows of one expert with "
                        "cosine >= THRESHOLD in (0, 1] sent and computed once; 0 = off")
    return p


def add_data_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the text, the held-out loss, the seed and Keel's config, which the examples
    built on this one share."""
    p.add_argument("--eval-batches", type=int, default=8,
                   help="held-out sequences per rank for the final held-out loss")
    p.add_argument("--seed", type=int, default=1, help="seed of weights and data (every mode)")
    p.add_argument("--text", default="",
                   help="train on this UTF-8 file instead of the KJV Bible from `bible`")
    p.add_argument("--config", default="",
                   help="Keel config (YAML) for the keel modes; default: one node of --ranks "
                        "GPUs sized to this model on a CPU, migration over UCX")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses bad values by flag name (p.error) and sets args.policies, the modes to train."""
    if not 0.0 <= args.condense <= 1.0:
        p.error(f"--condense must be in (0, 1] (0 = off), got {args.condense}")
    if args.condense > 0 and args.policy:
        p.error("--condense compares keel without and with condensation; leave --policy out")
    args.policies = (["keel", "keel+condense"] if args.condense > 0
                     else args.policy or ["static", "keel"])
    for name in ("ranks", "steps", "layers", "experts", "top_k", "d_model", "ffn", "heads",
                 "seq_len", "batch", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.aux_loss < 0:
        p.error(f"--aux-loss must be >= 0, got {args.aux_loss}")
    if args.micro_batches < 1 or args.batch % args.micro_batches:
        p.error(f"--micro-batches {args.micro_batches} must be >= 1 and divide --batch "
                f"{args.batch}")
    if args.save and args.resume and os.path.abspath(args.save) == os.path.abspath(args.resume):
        p.error(f"--save and --resume name the same folder {args.save!r}: saving would replace "
                f"the checkpoint being resumed; give --save another folder")


# --- data ---------------------------------------------------------------------------------------
def load_text(path: str) -> str:
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as error:
            sys.exit(f"train_moe_lm: --text {path}: {error}")
        return text
    if shutil.which("bible") is None:
        sys.exit("train_moe_lm: the `bible` command is missing: install Debian's bible-kjv and "
                 "bible-kjv-text (scripts/dev does), or pass --text FILE")
    raw = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    # "Ge1:1 In the beginning..." -> the verse text alone.
    return re.sub(r"(?m)^\S+?\d+:\d+ ", "", raw)


def load_text_for(args: argparse.Namespace, program: str) -> str:
    """--text (or the Bible), long enough that the held-out 5% holds a couple of sequences of
    --seq-len; else ``program`` exits saying so."""
    text = load_text(args.text)
    if len(text) < 40 * (args.seq_len + 1):
        sys.exit(f"{program}: the text has {len(text)} characters; --seq-len {args.seq_len} "
                 f"needs at least {40 * (args.seq_len + 1)}")
    return text


class Corpus:
    """The text as character ids: the first 95% to train on, the rest held out."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
        cut = int(len(ids) * 0.95)
        self.train, self.heldout = ids[:cut], ids[cut:]

    def batch(self, data: torch.Tensor, count: int, length: int,
              generator: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(data) - length - 1, (count,), generator=generator)
        return torch.stack([data[s:s + length + 1] for s in starts.tolist()])


# --- model --------------------------------------------------------------------------------------
class Block(torch.nn.Module):
    """Pre-norm attention, then a top-k MoE FFN whose experts Keel places."""

    def __init__(self, args: argparse.Namespace, moe: torch.nn.Module) -> None:
        super().__init__()
        d = args.d_model
        self.heads, self.top_k = args.heads, args.top_k
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.router = torch.nn.Linear(d, args.experts, bias=False)
        self.moe = moe

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        attention = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, d))

        h = self.norm2(x).reshape(b * s, d)
        probs = torch.softmax(self.router(h), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # Switch/Mixtral load balancing: E * sum_e (share of choices to e) * (mean prob of e).
        experts = probs.shape[1]
        share = torch.zeros(experts).index_add_(0, ids.reshape(-1), torch.ones(ids.numel()))
        aux = experts * torch.sum(share / ids.numel() * probs.mean(dim=0))
        x = x + self.moe(h, ids, weights).reshape(b, s, d)
        return x, aux


class CharMoE(torch.nn.Module):
    def __init__(self, args: argparse.Namespace, vocab: int, moe: kt.KeelMoE) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, args.d_model)
        self.position = torch.nn.Embedding(args.seq_len, args.d_model)
        self.blocks = torch.nn.ModuleList(Block(args, moe.layer(l)) for l in range(args.layers))
        self.norm = torch.nn.LayerNorm(args.d_model)
        self.head = torch.nn.Linear(args.d_model, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(args.seq_len, args.seq_len,
                                                           dtype=torch.bool), diagonal=1))

    def forward(self, ids: torch.Tensor) -> tuple:
        x = self.embed(ids) + self.position(torch.arange(ids.shape[1]))
        aux = x.new_zeros(())
        for block in self.blocks:
            x, layer_aux = block(x, self.mask[:ids.shape[1], :ids.shape[1]])
            aux = aux + layer_aux
        return self.head(self.norm(x)), aux / len(self.blocks)


def dense_parameters(model: torch.nn.Module, moe: kt.KeelMoE) -> List[torch.nn.Parameter]:
    expert = {id(p) for p in moe.parameters()}
    return [p for p in model.parameters() if id(p) not in expert]


def average_gradients(params: List[torch.nn.Parameter], size: int, group: Any = None) -> None:
    """Averages `params`' gradients over `group`'s `size` ranks in one all-reduce of a flat
    bucket (a parameter without a gradient counts as zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    at = 0
    for p, g in zip(params, grads):
        p.grad = flat[at:at + g.numel()].view_as(g)
        at += g.numel()


def gather_rows(rows: List[int], loss: float, rank: int,
                world: int) -> Tuple[torch.Tensor, float]:
    """Every rank's expert rows per layer (``[world, layers]`` float64) and the ranks' losses
    summed, in one all-reduce."""
    every = torch.zeros(world, len(rows), dtype=torch.float64)
    every[rank] = torch.tensor(rows, dtype=torch.float64)
    sums = torch.cat([every.reshape(-1), torch.tensor([loss], dtype=torch.float64)])
    dist.all_reduce(sums)
    return sums[:-1].reshape(world, len(rows)), sums[-1].item()


def keel_config(args: argparse.Namespace, world: int, policy: str) -> keel.Config:
    if args.config:
        return keel.Config.from_file(args.config).replace({"policy": {"name": policy}})
    return keel.Config.from_dict({
        # gloo's all-to-all between processes on loopback moves about 1 GB/s here.
        "topology": {"num_nodes": 1, "gpus_per_node": world,
                     "intra_node_gb_per_s": 1.0, "inter_node_gb_per_s": 1.0},
        # The static placement plus one spare persistent slot and one transient slot per rank,
        # as `keel demo` has.
        "slots": {"persistent_per_rank": -(-args.experts // world) + 1, "transient_per_rank": 1},
        # The experts' size, and what one CPU thread achieves on them with OpenBLAS (50 GFLOP/s
        # on the default experts; Debian's reference BLAS without OpenBLAS gives 3).
        "cost_model": {"hidden_size": args.d_model, "expert_ffn_size": args.ffn,
                       "expert_tflops": 0.05, "dtype_bytes": 4,
                       "home_move_bytes_per_parameter": 12.0},
        "policy": {"name": policy, "replan_interval_steps": 2},
        "migration": {"transport": "ucx", "deadline_seconds": 60},
        "engine": {"collective_timeout_seconds": 120},
    })


# --- one rank's run -----------------------------------------------------------------------------
class Mode:
    """One policy's model, engine and optimizer on this rank, and what its steps measured."""

    KEYS = ("parallel", "expert", "communication", "dense", "control", "exposed", "dispatch",
            "imbalance", "loss", "epoch")

    def __init__(self, name: str, args: argparse.Namespace, world: int, vocab: int) -> None:
        torch.manual_seed(args.seed)  # the dense weights: the same on every rank, in every mode
        # A mode is a policy, or "keel+condense": keel with token condensation.
        policy, condense = (name[:-len("+condense")], args.condense) \
            if name.endswith("+condense") else (name, 0.0)
        self.policy, self.args, self.world = name, args, world
        self.moe = kt.KeelMoE(kt.ffn_expert(args.d_model, args.ffn), num_layers=args.layers,
                              num_experts=args.experts, top_k=args.top_k,
                              config=keel_config(args, world, policy), seed=args.seed,
                              condense_threshold=condense)
        self.model = CharMoE(args, vocab, self.moe)
        self.dense = dense_parameters(self.model, self.moe)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.moe.attach(self.optimizer)
        self.per_step: Dict[str, List[float]] = {k: [] for k in self.KEYS}
        self.layer_imbalance = [0.0] * args.layers
        self.exposed_before = 0.0
        self.wall = 0.0

    def step(self, batch: torch.Tensor, rank: int) -> None:
        args, world, moe = self.args, self.world, self.moe
        started_wall = time.monotonic()
        moe.times = times = kt.StepTimes(args.layers)
        thread_started = time.thread_time()
        # Gradient accumulation: each micro-batch's forward and backward, its loss scaled so
        # that the step's gradient is the whole batch's mean.
        loss = torch.zeros(())
        for micro_batch in batch.chunk(args.micro_batches):
            logits, aux = self.model(micro_batch[:, :-1])
            part = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   micro_batch[:, 1:].reshape(-1)) / args.micro_batches
            (part + args.aux_loss * aux / args.micro_batches).backward()
            loss += part.detach()
        fwd_bwd_thread = time.thread_time() - thread_started
        control_started = time.process_time()
        # Dense gradients are averaged over the ranks (DistributedDataParallel's job); the
        # experts' are Keel's, folded into their homes by the hook inside optimizer.step().
        average_gradients(self.dense, world)
        self.optimizer.step()
        self.optimizer.zero_grad()
        # The whole phase: dense all-reduce, Keel's hooks (reduce_gradients, step_end) and Adam.
        control = time.process_time() - control_started
        self.wall += time.monotonic() - started_wall
        moe.times = None
        stats = moe.stats()
        exposed = stats["exposed_migration_seconds"] - self.exposed_before
        self.exposed_before = stats["exposed_migration_seconds"]
        dense_thread = (fwd_bwd_thread - sum(times.expert) - times.route_thread
                        - times.exchange_thread)

        # The step as separate GPUs would take it: maxima over ranks.
        L = args.layers
        maxima = torch.tensor(times.expert + times.communication +
                              [dense_thread, control, exposed, times.dispatch],
                              dtype=torch.float64)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        rows, summed_loss = gather_rows(times.rows, loss.item(), rank, world)
        imbalances = (rows.max(dim=0).values * world / rows.sum(dim=0).clamp(min=1)).tolist()
        for l in range(L):
            self.layer_imbalance[l] += imbalances[l] / args.steps
        expert, communication = maxima[:L].sum().item(), maxima[L:2 * L].sum().item()
        dense, control, exposed, dispatch = maxima[2 * L:].tolist()
        parallel = expert + communication + dense + control + exposed
        for key, value in (("parallel", parallel), ("expert", expert),
                           ("communication", communication), ("dense", dense),
                           ("control", control), ("exposed", exposed), ("dispatch", dispatch),
                           ("imbalance", sum(imbalances) / L),
                           ("loss", summed_loss / world), ("epoch", stats["epoch"])):
            self.per_step[key].append(value)
        self.rank_rows = rows.sum(1).tolist()

    # --- checkpoints (docs/pytorch.md, "Checkpoints") -------------------------------------------
    def save(self, folder: str, rank: int) -> Dict[str, Any]:
        """Saves the model (experts by logical id), the experts' Adam state and the dense
        Adam state into `folder`: seconds (the slowest rank's) and bytes written."""
        import torch.distributed.checkpoint as dcp
        started = time.monotonic()
        os.makedirs(folder, exist_ok=True)
        dcp.save({"model": self.model.state_dict(),
                  "experts_adam": self.moe.optimizer_state_dict()}, checkpoint_id=folder)
        if rank == 0:  # the dense Adam state is the same on every rank; Keel's slots are left out
            torch.save(self.optimizer.state_dict(), os.path.join(folder, "dense_optimizer.pt"))
        dist.barrier()
        seconds = torch.tensor([time.monotonic() - started], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        written = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
        return {"seconds": seconds.item(), "bytes": written}

    def resume(self, folder: str) -> float:
        """Loads a checkpoint of `save` (from any number of ranks) into this mode's fresh model:
        the slowest rank's seconds."""
        import torch.distributed.checkpoint as dcp
        started = time.monotonic()
        # Into copies first, so that a bad checkpoint changes nothing.
        state = {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                 "experts_adam": {k: v.clone() for k, v in self.moe.optimizer_state_dict().items()}}
        dcp.load(state, checkpoint_id=folder)
        self.model.load_state_dict(state["model"])
        self.moe.load_optimizer_state_dict(state["experts_adam"])
        self.optimizer.load_state_dict(torch.load(os.path.join(folder, "dense_optimizer.pt")))
        seconds = torch.tensor([time.monotonic() - started], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return seconds.item()

    def report(self, heldout: float) -> Dict[str, Any]:
        per_step, args = self.per_step, self.args
        mean = lambda key: sum(per_step[key]) / len(per_step[key])  # noqa: E731
        stats = self.moe.stats()
        return {
            "policy": self.policy,
            **step_report(per_step, self.layer_imbalance),
            "dispatch_seconds": mean("dispatch"),
            "python_overhead_fraction": mean("dispatch") / mean("parallel"),
            "epochs": stats["epochs_committed"],
            "epochs_aborted": stats["epochs_aborted"],
            "epoch_per_step": per_step["epoch"],
            "bytes_moved": stats["bytes_moved"],
            "heldout_loss": heldout,
            "tokens_per_second": args.batch * args.seq_len * self.world * args.steps / self.wall,
            "wall_seconds": self.wall,
            # This rank's forward rows dispatched, and sent after condensation (equal without).
            "condensation_rows": list(self.moe.condensation_rows),
        }


def step_report(per_step: Dict[str, List[float]],
                layer_imbalance: List[float]) -> Dict[str, Any]:
    """A mode's report fields from its per-step values (parallel, expert, communication, dense,
    control, exposed, imbalance, loss), which the examples built on this one share."""
    mean = lambda key: sum(per_step[key]) / len(per_step[key])  # noqa: E731
    return {
        "parallel_step_seconds": {"mean": mean("parallel"), "per_step": per_step["parallel"]},
        "expert_seconds": mean("expert"),
        "communication_seconds": mean("communication"),
        "dense_seconds": mean("dense"),
        "control_seconds": mean("control"),
        "exposed_migration_seconds": mean("exposed"),
        "per_step": {k: per_step[k] for k in ("expert", "communication", "dense", "control")},
        "mean_imbalance": mean("imbalance"),
        "imbalance": per_step["imbalance"],
        "imbalance_per_layer": layer_imbalance,
        "loss": per_step["loss"],
    }


def train(rank: int, world: int, args: argparse.Namespace,
          text: str) -> Optional[Dict[str, Dict[str, Any]]]:
    """Trains every mode of args.policies on this rank, step by step in turn, so that each step
    of every mode sees the same batch and the same machine (a shared machine's speed drifts
    over minutes); returns the modes' reports on rank 0."""
    torch.set_num_threads(1)  # one GPU per rank: its time is this thread's time
    corpus = Corpus(text)
    modes = [Mode(policy, args, world, len(corpus.chars)) for policy in args.policies]
    resumed = {mode.policy: mode.resume(os.path.join(args.resume, mode.policy))
               for mode in modes} if args.resume else {}
    data = torch.Generator().manual_seed(args.seed * 7919 + rank)
    terminal = sys.stderr.isatty()
    for step in range(args.steps):
        batch = corpus.batch(corpus.train, args.batch, args.seq_len, data)
        for mode in modes:
            mode.step(batch, rank)
        last = step + 1 == args.steps
        if rank == 0 and not args.quiet and (terminal or (step + 1) % 10 == 0 or last):
            line = "  ".join(
                f"{m.policy} {m.per_step['parallel'][-1] * 1e3:6.1f} ms "
                f"imb {m.per_step['imbalance'][-1]:.3f} "
                + "".join("▁▂▃▄▅▆▇█"[min(7, round(7 * r / max(1.0, max(m.rank_rows))))]
                          for r in m.rank_rows)
                + f" ep {m.per_step['epoch'][-1]}" for m in modes)
            print(f"{chr(13) if terminal else ''}step {step + 1:4d}/{args.steps}  loss "
                  f"{modes[0].per_step['loss'][-1]:.4f}  {line}", end="" if terminal and not last
                  else "\n", file=sys.stderr, flush=True)
    reports = {mode.policy: mode.report(evaluate(mode.model, mode.moe, corpus, args, rank))
               for mode in modes}
    for mode in modes:
        if args.save:
            reports[mode.policy]["checkpoint"] = mode.save(os.path.join(args.save, mode.policy),
                                                           rank)
        if mode.policy in resumed:
            reports[mode.policy]["resume_seconds"] = resumed[mode.policy]
        mode.moe.close()
    return reports if rank == 0 else None


@torch.no_grad()
def evaluate(model: CharMoE, moe: kt.KeelMoE, corpus: Corpus, args: argparse.Namespace,
             rank: int) -> float:
    """Mean cross-entropy over the same held-out sequences in every mode (each rank its share),
    in one forward pass."""
    generator = torch.Generator().manual_seed(args.seed * 104729 + rank)
    batch = corpus.batch(corpus.heldout, args.eval_batches, args.seq_len, generator)
    logits, _ = model(batch[:, :-1])
    moe.end_forward_pass()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                           reduction="sum")
    total = torch.tensor([loss.item(), float(batch[:, 1:].numel())], dtype=torch.float64)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


# --- launching ----------------------------------------------------------------------------------
def blas_library() -> str:
    """The BLAS torch's products run on: the one built into torch (``mkl`` in PyPI's wheels, by
    torch's build configuration), else the system library this process maps (Debian's torch
    links libblas.so.3, whichever BLAS that is), or "" when it cannot tell."""
    built_in = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    if built_in and built_in.group(1) == "mkl":
        return "mkl (built into torch)"
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return ""
    blas = sorted(p for p in paths if re.search(r"blas|mkl|blis", os.path.basename(p)))
    return ", ".join(blas)


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, text: str,
             results: Any, trainer: Callable[..., Any] = train) -> None:
    for key, value in LOOPBACK.items():
        os.environ.setdefault(key, value)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    reports = trainer(rank, world, args, text)
    if rank == 0:
        results.put(json.dumps(reports))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(args: argparse.Namespace, text: str,
              trainer: Callable[..., Any] = train) -> Dict[str, Dict[str, Any]]:
    """Starts --ranks processes, each running ``trainer(rank, world, args, text)`` (default:
    train), and returns rank 0's reports."""
    import torch.multiprocessing as mp
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = [context.Process(target=_spawned,
                                 args=(r, args.ranks, port, args, text, results, trainer))
                 for r in range(args.ranks)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    failed = [r for r, p in enumerate(processes) if p.exitcode != 0]
    if failed:
        sys.exit(f"train_moe_lm: ranks {failed} failed (exit codes "
                 f"{[processes[r].exitcode for r in failed]})")
    return json.loads(results.get())


def summarize(modes: Dict[str, Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    header = ("mode", "step ms", "expert ms", "comm ms", "dense ms", "imbalance", "epochs",
              "moved MB", "tok/s", "loss first", "loss last", "held-out", "python %")
    rows = []
    for name, m in modes.items():
        rows.append((name, f"{m['parallel_step_seconds']['mean'] * 1e3:.1f}",
                     f"{m['expert_seconds'] * 1e3:.1f}", f"{m['communication_seconds'] * 1e3:.1f}",
                     f"{m['dense_seconds'] * 1e3:.1f}", f"{m['mean_imbalance']:.3f}",
                     str(m["epochs"]), f"{m['bytes_moved'] / 1e6:.2f}",
                     f"{m['tokens_per_second']:.0f}", f"{m['loss'][0]:.4f}",
                     f"{m['loss'][-1]:.4f}", f"{m['heldout_loss']:.4f}",
                     f"{m['python_overhead_fraction'] * 100:.2f}"))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))
    comparison: Dict[str, Any] = {}
    if "static" in modes and "keel" in modes:
        static, ours = modes["static"], modes["keel"]
        target = 0.85 if args.aux_loss > 0 else 0.7
        ratio = ours["parallel_step_seconds"]["mean"] / static["parallel_step_seconds"]["mean"]
        loss_gap = abs(ours["heldout_loss"] - static["heldout_loss"]) / static["heldout_loss"]
        # What a keel that balanced perfectly at no cost would reach: static's step with its
        # expert time at the balanced ideal (divided by its mean imbalance), the rest as measured.
        static_step = static["parallel_step_seconds"]["mean"]
        balanced = (static["expert_seconds"] / static["mean_imbalance"]
                    + static_step - static["expert_seconds"])
        bound = balanced / static_step
        comparison = {
            "parallel_step_ratio": {"value": ratio, "target": target, "met": ratio <= target},
            "no_cost_bound": bound,
            "gap_to_no_cost_bound": {"value": ratio - bound, "target": 0.03,
                                     "met": ratio - bound <= 0.03},
            "keel_mean_imbalance": {"value": ours["mean_imbalance"], "target": 1.10,
                                    "met": ours["mean_imbalance"] <= 1.10},
            "heldout_loss_gap": {"value": loss_gap, "target": 0.01, "met": loss_gap <= 0.01},
            "python_overhead_fraction": {"value": ours["python_overhead_fraction"],
                                         "target": 0.05,
                                         "met": ours["python_overhead_fraction"] <= 0.05},
            "static_mean_imbalance": static["mean_imbalance"],
        }
        print()
        met = lambda c: "met" if c["met"] else "MISSED"  # noqa: E731
        print(f"keel / static parallel step: {ratio:.3f} (target <= {target}: "
              f"{met(comparison['parallel_step_ratio'])})")
        print(f"no-cost bound:               {bound:.3f} (keel's gap to it: {ratio - bound:.3f}, "
              f"target <= 0.03: {met(comparison['gap_to_no_cost_bound'])})")
        print(f"keel mean imbalance:         {ours['mean_imbalance']:.3f} (target <= 1.10: "
              f"{met(comparison['keel_mean_imbalance'])}; static {static['mean_imbalance']:.3f})")
        print(f"held-out loss gap:           {loss_gap * 100:.2f}% (target <= 1%: "
              f"{met(comparison['heldout_loss_gap'])})")
        print(f"Python dispatch overhead:    {ours['python_overhead_fraction'] * 100:.2f}% of "
              f"the step (target <= 5%: {met(comparison['python_overhead_fraction'])})")
    if "keel" in modes and "keel+condense" in modes:
        exact, condensed = modes["keel"], modes["keel+condense"]
        rows, kept = condensed["condensation_rows"]
        saved = 1.0 - kept / rows if rows else 0.0
        gap = (condensed["heldout_loss"] - exact["heldout_loss"]) / exact["heldout_loss"]
        ratio = (condensed["parallel_step_seconds"]["mean"]
                 / exact["parallel_step_seconds"]["mean"])
        comparison = {"condense_threshold": args.condense, "rows_saved_fraction": saved,
                      "heldout_loss_difference": gap, "parallel_step_ratio": ratio}
        print()
        print(f"rows saved by condensation:  {saved * 100:.2f}% of rank 0's forward dispatch "
              f"(threshold {args.condense})")
        print(f"held-out loss, condensed:    {condensed['heldout_loss']:.4f} against "
              f"{exact['heldout_loss']:.4f} exact ({gap * 100:+.3f}%)")
        print(f"keel+condense / keel step:   {ratio:.3f}")
    return comparison


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    text = load_text_for(args, "train_moe_lm")
    settings = {k: v for k, v in vars(args).items()
                if k not in ("policy", "report", "quiet", "save", "resume")}
    settings["blas"] = blas_library()
    if settings["blas"] and not re.search(r"openblas|mkl|blis", settings["blas"]):
        print(f"train_moe_lm: torch runs on the reference BLAS ({settings['blas']}), about 16 "
              f"times slower than OpenBLAS, and the experts no longer lead the step: use PyPI's "
              f"torch (MKL built in; scripts/dev's .venv has it) or install OpenBLAS (Debian: "
              f"libopenblas0-serial)", file=sys.stderr)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        for key, value in LOOPBACK.items():
            os.environ.setdefault(key, value)
        dist.init_process_group("gloo")
        modes = train(dist.get_rank(), dist.get_world_size(), args, text)
        dist.destroy_process_group()
        if modes is None:
            return 0
    else:
        if not args.quiet:
            print(f"train_moe_lm: {args.ranks} ranks, {args.layers} layers x {args.experts} "
                  f"experts top-{args.top_k}, d_model {args.d_model}, FFN {args.ffn}, "
                  f"{args.batch} x {args.seq_len} characters per rank, {args.steps} steps, aux "
                  f"loss {args.aux_loss}, modes {', '.join(args.policies)} (in turn, step by "
                  f"step); text: {len(text)} characters", file=sys.stderr)
        modes = run_ranks(args, text)
    comparison = summarize(modes, args)
    if args.report:
        write_report(args.report, {"example": "train_moe_lm", "settings": settings,
                                   "modes": modes, "comparison": comparison})
    return 0


def write_report(path: str, report: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(temporary, path)
    print(f"report: {path}")


if __name__ == "__main__":
    sys.exit(main())
