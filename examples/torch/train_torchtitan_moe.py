#!/usr/bin/env python3
"""Trains a small model of torchtitan's own zoo on the King James Bible, 4 ranks on the CPU:
torchtitan's expert parallelism against Keel inside the same model (keel.integrations.torchtitan),
each with torchtitan's expert-bias balancing on (its default) and off.

The model is torchtitan's DeepSeek-V3 "debugmodel" flavour (its smallest MoE: dim 256, 8 routed
SwiGLU experts of 256, top-3 softmax router, 2 shared experts, MLA attention, a dense first
layer), shrunk to fit a 2-core machine: its first --layers layers (1 dense + 2 MoE by default),
--heads attention heads instead of 16, and PyTorch's scaled-dot-product attention (causal) as
the inner attention, since its flex attention needs torch >= 2.12 and varlen attention a GPU
(docs/integrations/torchtitan.md). The text is character ids, as in train_moe_lm.py. Every mode
trains through torchtitan's own code: its model (built from its config, initialized by its
init_weights), its AdamW in an OptimizersContainer with its LR scheduler, its cross-entropy loss
normalized by the global token count, and its optimizer hook that updates the expert bias.
torchtitan's Trainer does not run here (it selects CUDA when torch sees no accelerator, and its
attention and FSDP-with-EP paths need a newer torch), so a short loop calls those pieces.

Modes (trained in turn, step by step, from the same weights on the same batches):

- ``ep``, ``ep-nobias``: torchtitan's expert parallelism (``parallelism.expert_parallel_degree``
  = 4: ``model.parallelize`` shards the experts 2 per rank, its AllToAllTokenDispatcher moves
  the tokens);
- ``keel``, ``keel-nobias``: ``use_keel`` swaps every MoE layer's ``routed_experts`` for Keel's
  (policy keel: replicas, transient replicas, migration);

``-nobias`` turns the expert bias off (``load_balance_coeff = None``). Dense gradients are
summed over the ranks in one all-reduce of a flat bucket (torchtitan's FSDP would reduce-scatter
them; with expert parallelism it needs a newer torch, see above); the loss is normalized by the
global token count, as torchtitan's is, so every gradient is the global mean's.

The report (``--report``) is shaped like train_moe_lm.py's: per mode ``parallel_step_seconds``
(the step four GPUs would take: per MoE layer the slowest rank's expert time plus the slowest
rank's token dispatch and combine, plus the slowest rank's other compute and optimizer phase,
all CPU time measured by hooks around torchtitan's modules), ``mean_imbalance`` (max over mean
of the rows each rank's experts computed), ``heldout_loss`` and the loss curve; ``comparison``
checks the targets of docs/integrations/torchtitan.md.

    scripts/dev torchtitan-demo                     # out/torchtitan-demo.json
    python examples/torch/train_torchtitan_moe.py --steps 20 --report /tmp/t.json

Needs torchtitan 0.3 (scripts/dev makes .venv-torchtitan with it) and the keel package.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_moe_lm as lm  # noqa: E402  (sets one BLAS thread per rank before torch loads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import keel  # noqa: E402
import keel.torch as kt  # noqa: E402

MODES = ("ep", "keel", "ep-nobias", "keel-nobias")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train torchtitan's DeepSeek-V3 debug model (shrunk) on the KJV Bible on "
                    "CPU ranks: torchtitan's expert parallelism against Keel, expert bias on "
                    "and off.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="processes (gloo ranks)")
    p.add_argument("--mode", action="append", choices=MODES,
                   help="mode to train; repeat for several (default: all four, in turn)")
    p.add_argument("--steps", type=int, default=60, help="training steps per mode")
    p.add_argument("--layers", type=int, default=3,
                   help="the debug model's first layers kept (its first is dense)")
    p.add_argument("--heads", type=int, default=2, help="MLA attention heads (the flavour: 16)")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--warmup", type=int, default=2, help="LR warmup steps (torchtitan's)")
    lm.add_data_flags(p)  # --eval-batches, --seed, --text, --config
    p.add_argument("--report", default="", help="write the JSON report here")
    p.add_argument("--quiet", action="store_true", help="no per-step progress")
    args = p.parse_args(argv)
    for name in ("ranks", "steps", "layers", "heads", "seq_len", "batch", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.layers < 2:
        p.error(f"--layers {args.layers}: the first layer is dense, so an MoE needs 2")
    args.modes = args.mode or list(MODES)
    return args


# --- torchtitan's model, shrunk ------------------------------------------------------------------
def debug_model_config(args: argparse.Namespace, world: int, expert_parallel: bool,
                       expert_bias: bool) -> Any:
    """torchtitan's DeepSeek-V3 debugmodel config, shrunk (module docstring), and its
    ParallelismConfig. Returns (model spec, model config, parallelism)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import make_mla_attention_config, model_registry

    spec = model_registry("debugmodel")
    config = spec.model
    config.layers = config.layers[:args.layers]
    for layer_id, layer in enumerate(config.layers):
        mla = layer.attention
        layer.attention = make_mla_attention_config(
            layer_id=layer_id, dim=mla.dim, n_heads=args.heads, q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
            mscale=mla.mscale, attn_backend="flex", linear_init=mla.wkv_a.param_init,
            norm_init=mla.kv_norm.param_init, depth_init=lambda _, init=mla.wo.param_init: init,
            rope=mla.rope)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if layer.moe is not None and not expert_bias:
            layer.moe.load_balance_coeff = None
    parallelism = ParallelismConfig(expert_parallel_degree=world if expert_parallel else 1,
                                    data_parallel_shard_degree=world,
                                    spmd_backend="partial_dtensor")
    config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    return spec, config, parallelism


def keel_config(args: argparse.Namespace, world: int, config: Any) -> keel.Config:
    if args.config:
        return keel.Config.from_file(args.config)
    moe = next(layer.moe for layer in config.layers if layer.moe is not None)
    experts = moe.num_experts
    return keel.Config.from_dict({
        "topology": {"num_nodes": 1, "gpus_per_node": world,
                     "intra_node_gb_per_s": 1.0, "inter_node_gb_per_s": 1.0},
        "slots": {"persistent_per_rank": -(-experts // world) + 1, "transient_per_rank": 1},
        # torchtitan's experts: SwiGLU in bfloat16 grouped GEMMs, about 430 GFLOP/s on one
        # core of the development machine (AVX-512 bfloat16), float32 master weights.
        "cost_model": {"hidden_size": config.dim,
                       "expert_ffn_size": moe.routed_experts.inner_experts.hidden_dim,
                       "expert_matrices": 3, "expert_tflops": 0.4, "dtype_bytes": 4,
                       "top_k": moe.router.top_k, "home_move_bytes_per_parameter": 12.0},
        "policy": {"name": "keel", "replan_interval_steps": 2},
        "migration": {"transport": "ucx", "deadline_seconds": 60},
        "engine": {"collective_timeout_seconds": 120},
    })


# --- measuring around torchtitan's modules -----------------------------------------------------
def clock_module(module: torch.nn.Module, add: Callable[[float, float], None],
                 rows: Optional[Callable[[int], None]] = None) -> None:
    """Hooks that ``add(process seconds, thread seconds)`` of every forward and backward of
    ``module``, and ``rows(n)`` with its forward's first input's rows."""
    started = [0.0, 0.0]

    def start(*_: Any) -> None:
        started[0], started[1] = time.process_time(), time.thread_time()

    def stop(*_: Any) -> None:
        add(time.process_time() - started[0], time.thread_time() - started[1])

    def forward_start(_: Any, inputs: Any) -> None:
        if rows is not None:
            rows(int(inputs[0].shape[0]))
        start()

    module.register_forward_pre_hook(forward_start)
    module.register_forward_hook(stop)
    module.register_full_backward_pre_hook(start)
    module.register_full_backward_hook(stop)


class LayerTimes:
    """One step's CPU seconds per MoE layer on this rank: ``routed`` (process, thread) in the
    routed experts module (dispatch, experts, combine; forward and backward), ``expert`` (thread)
    in the experts alone, ``rows`` the experts computed."""

    def __init__(self, layers: int) -> None:
        self.routed_process = [0.0] * layers
        self.routed_thread = [0.0] * layers
        self.expert = [0.0] * layers
        self.rows = [0] * layers


# --- one rank's run -----------------------------------------------------------------------------
class Mode:
    """One mode's model, optimizer and measurements on this rank."""

    KEYS = ("parallel", "expert", "communication", "dense", "control", "exposed", "imbalance",
            "loss", "epoch")

    def __init__(self, name: str, args: argparse.Namespace, world: int, dims: Dict[bool, Any],
                 vocab: int) -> None:
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torch.distributed.tensor import DTensor
        import keel.integrations.torchtitan as titan

        self.name, self.args, self.world = name, args, world
        self.expert_parallel = name.startswith("ep")
        spec, config, _ = debug_model_config(args, world, self.expert_parallel,
                                             expert_bias=not name.endswith("-nobias"))
        if vocab > config.vocab_size:
            raise SystemExit(f"train_torchtitan_moe: the text has {vocab} characters, more than "
                             f"the model's vocabulary of {config.vocab_size}")
        torch.manual_seed(args.seed)  # the same weights in every mode and on every rank
        self.model = config.build()
        with torch.no_grad():
            self.model.init_weights(buffer_device=None)
        self.moe: Optional[kt.KeelMoE] = None
        if self.expert_parallel:
            self.model.parallelize(dims[True])
        else:
            self.moe = titan.use_keel(self.model, config=keel_config(args, world, config),
                                      average_gradients=False)
        slots = {id(p) for p in self.moe.parameters()} if self.moe is not None else set()
        self.dense = [p for p in self.model.parameters()
                      if not isinstance(p, DTensor) and id(p) not in slots]
        optimizer_config = default_adamw(lr=args.lr)
        # One loop over the parameters: torchtitan's fused and foreach AdamW take either
        # DTensors (FSDP's) or plain tensors in one group, and ep mixes them without FSDP.
        optimizer_config.implementation = "for-loop"
        self.optimizers = optimizer_config.build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=args.warmup).build(
            optimizers=self.optimizers, training_steps=args.steps)
        if self.moe is not None:
            titan.attach(self.moe, self.optimizers)
        # torchtitan's expert-bias update, a pre-hook of the optimizer step (none without bias).
        spec.post_optimizer_build_fn(self.optimizers, [self.model], dims[self.expert_parallel])
        self.loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(
            global_vocab_size=config.vocab_size))
        self.layers = [moe for _, moe in titan.moe_layers(self.model)]
        self.times = LayerTimes(len(self.layers))
        self._hook_layers()
        self.per_step: Dict[str, List[float]] = {k: [] for k in self.KEYS}
        self.layer_imbalance = [0.0] * len(self.layers)
        self.exposed_before = 0.0
        self.wall = 0.0

    def _hook_layers(self) -> None:
        for l, moe in enumerate(self.layers):
            def routed(process: float, thread: float, l: int = l) -> None:
                self.times.routed_process[l] += process
                self.times.routed_thread[l] += thread
            clock_module(moe.routed_experts, routed)
            if self.expert_parallel:  # Keel's dispatcher times its experts itself (StepTimes)
                def expert(_: float, thread: float, l: int = l) -> None:
                    self.times.expert[l] += thread

                def rows(n: int, l: int = l) -> None:
                    if self.model.training:
                        self.times.rows[l] += n
                clock_module(moe.routed_experts.inner_experts, expert, rows)

    def step(self, batch: torch.Tensor) -> None:
        args, world = self.args, self.world
        L = len(self.layers)
        self.times = LayerTimes(L)
        keel_times = kt.StepTimes(L) if self.moe is not None else None
        if self.moe is not None:
            self.moe.times = keel_times
        started_wall, started_thread = time.monotonic(), time.thread_time()
        inputs, labels = batch[:, :-1], batch[:, 1:]
        tokens = torch.tensor(float(labels.numel() * world))
        loss, _ = self.loss_fn(self.model(inputs), labels, tokens)
        loss.backward()
        forward_backward = time.thread_time() - started_thread
        control_started = time.process_time()
        # Summed (size 1), in one bucket: torchtitan's loss is already the global mean's share.
        lm.average_gradients(self.dense, 1)
        self.optimizers.step()  # hooks: expert bias; Keel's reduce_gradients and step_end
        self.schedulers.step()
        self.optimizers.zero_grad()
        control = time.process_time() - control_started
        self.wall += time.monotonic() - started_wall
        exposed, epoch = 0.0, 0
        if self.moe is not None:
            self.moe.times = None
            self.times.expert = list(keel_times.expert)
            self.times.rows = list(keel_times.rows)
            stats = self.moe.stats()
            exposed = stats["exposed_migration_seconds"] - self.exposed_before
            self.exposed_before = stats["exposed_migration_seconds"]
            epoch = stats["epoch"]
        times = self.times
        dispatch = [max(0.0, p - e) for p, e in zip(times.routed_process, times.expert)]
        dense = forward_backward - sum(times.routed_thread)
        maxima = torch.tensor(times.expert + dispatch + [dense, control, exposed],
                              dtype=torch.float64)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        rows, summed_loss = lm.gather_rows(times.rows, loss.item(), dist.get_rank(), world)
        imbalances = (rows.max(dim=0).values * world / rows.sum(dim=0).clamp(min=1)).tolist()
        for l in range(L):
            self.layer_imbalance[l] += imbalances[l] / args.steps
        expert, communication = maxima[:L].sum().item(), maxima[L:2 * L].sum().item()
        dense, control, exposed = maxima[2 * L:].tolist()
        for key, value in (("parallel", expert + communication + dense + control + exposed),
                           ("expert", expert), ("communication", communication),
                           ("dense", dense), ("control", control), ("exposed", exposed),
                           ("imbalance", sum(imbalances) / L), ("loss", summed_loss),
                           ("epoch", epoch)):
            self.per_step[key].append(value)

    @torch.no_grad()
    def heldout_loss(self, corpus: lm.Corpus, rank: int) -> float:
        """Mean cross-entropy over the same held-out sequences in every mode."""
        generator = torch.Generator().manual_seed(self.args.seed * 104729 + rank)
        batch = corpus.batch(corpus.heldout, self.args.eval_batches, self.args.seq_len,
                             generator)
        self.model.eval()
        total, _ = self.loss_fn(self.model(batch[:, :-1]), batch[:, 1:])
        self.model.train()
        if self.moe is not None:
            self.moe.end_forward_pass()
        sums = torch.tensor([total.item(), float(batch[:, 1:].numel())], dtype=torch.float64)
        dist.all_reduce(sums)
        return (sums[0] / sums[1]).item()

    def report(self, heldout: float) -> Dict[str, Any]:
        per_step, args = self.per_step, self.args
        out = {
            "mode": self.name,
            **lm.step_report(per_step, self.layer_imbalance),
            "heldout_loss": heldout,
            "tokens_per_second": args.batch * args.seq_len * self.world * args.steps / self.wall,
            "wall_seconds": self.wall,
        }
        if self.moe is not None:
            stats = self.moe.stats()
            out.update(epochs=stats["epochs_committed"], epochs_aborted=stats["epochs_aborted"],
                       epoch_per_step=per_step["epoch"], bytes_moved=stats["bytes_moved"])
        return out


def train(rank: int, world: int, args: argparse.Namespace,
          text: str) -> Optional[Dict[str, Dict[str, Any]]]:
    """Trains every mode on this rank, in turn step by step; rank 0 returns the reports."""
    torch.set_num_threads(1)  # one GPU per rank: its time is this thread's time
    import keel.integrations.torchtitan as titan
    titan.fill_torch_gaps()
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils as dist_utils
    # torchtitan builds its device meshes on "cuda" when torch sees no accelerator.
    parallel_dims.device_type = "cpu"
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = {}
    for expert_parallel in (True, False):
        _, _, parallelism = debug_model_config(args, world, expert_parallel, True)
        dims[expert_parallel] = parallel_dims.ParallelDims.from_config(parallelism, world)
        dims[expert_parallel].build_mesh()
    corpus = lm.Corpus(text)
    modes = [Mode(name, args, world, dims, len(corpus.chars)) for name in args.modes]
    data = torch.Generator().manual_seed(args.seed * 7919 + rank)
    for step in range(args.steps):
        batch = corpus.batch(corpus.train, args.batch, args.seq_len, data)
        for mode in modes:
            mode.step(batch)
        if rank == 0 and not args.quiet and ((step + 1) % 10 == 0 or step + 1 == args.steps):
            print(f"step {step + 1:4d}/{args.steps}  " + "  ".join(
                f"{m.name} loss {m.per_step['loss'][-1]:.3f} "
                f"{m.per_step['parallel'][-1] * 1e3:.0f} ms imb "
                f"{m.per_step['imbalance'][-1]:.2f}" for m in modes), file=sys.stderr, flush=True)
    reports = {mode.name: mode.report(mode.heldout_loss(corpus, rank)) for mode in modes}
    for mode in modes:
        if mode.moe is not None:
            mode.moe.close()
    return reports if rank == 0 else None


def compare(modes: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The targets of docs/integrations/torchtitan.md, for the pairs that ran."""
    comparison: Dict[str, Any] = {}
    for theirs, ours, target in (("ep-nobias", "keel-nobias", 0.85), ("ep", "keel", 1.0)):
        if theirs not in modes or ours not in modes:
            continue
        a, b = modes[theirs], modes[ours]
        ratio = b["parallel_step_seconds"]["mean"] / a["parallel_step_seconds"]["mean"]
        gap = abs(b["heldout_loss"] - a["heldout_loss"]) / a["heldout_loss"]
        # Perfect balance at no cost: torchtitan's step with its expert time divided by its
        # imbalance, the rest as measured.
        step = a["parallel_step_seconds"]["mean"]
        bound = (step - a["expert_seconds"] + a["expert_seconds"] / a["mean_imbalance"]) / step
        comparison[f"{ours}/{theirs}"] = {
            "parallel_step_ratio": {"value": ratio, "target": target, "met": ratio <= target},
            "no_cost_bound": bound,
            "expert_share_of_step": a["expert_seconds"] / step,
            "heldout_loss_gap": {"value": gap, "target": 0.01, "met": gap <= 0.01},
            "mean_imbalance": {theirs: a["mean_imbalance"], ours: b["mean_imbalance"]},
        }
    return comparison


def summarize(modes: Dict[str, Dict[str, Any]], comparison: Dict[str, Any]) -> None:
    header = ("mode", "step ms", "expert ms", "dispatch ms", "dense ms", "control ms",
              "imbalance", "loss first", "loss last", "held-out")
    rows = [(name, f"{m['parallel_step_seconds']['mean'] * 1e3:.1f}",
             f"{m['expert_seconds'] * 1e3:.1f}", f"{m['communication_seconds'] * 1e3:.1f}",
             f"{m['dense_seconds'] * 1e3:.1f}", f"{m['control_seconds'] * 1e3:.1f}",
             f"{m['mean_imbalance']:.3f}", f"{m['loss'][0]:.4f}", f"{m['loss'][-1]:.4f}",
             f"{m['heldout_loss']:.4f}") for name, m in modes.items()]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))
    for pair, found in comparison.items():
        ratio, gap = found["parallel_step_ratio"], found["heldout_loss_gap"]
        imbalance = ", ".join(f"{k} {v:.3f}" for k, v in found["mean_imbalance"].items())
        print(f"{pair}: parallel step {ratio['value']:.3f} (target <= {ratio['target']}: "
              f"{'met' if ratio['met'] else 'MISSED'}; no-cost bound "
              f"{found['no_cost_bound']:.3f}, experts {found['expert_share_of_step'] * 100:.1f}% "
              f"of the step), held-out loss gap {gap['value'] * 100:.2f}% (target <= 1%: "
              f"{'met' if gap['met'] else 'MISSED'}), imbalance {imbalance}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    text = lm.load_text_for(args, "train_torchtitan_moe")
    import torchtitan
    settings = {k: v for k, v in vars(args).items() if k not in ("mode", "report", "quiet")}
    settings.update(blas=lm.blas_library(), torch=torch.__version__,
                    torchtitan=torchtitan.__version__, machine=platform.processor() or
                    platform.machine(), cpus=os.cpu_count(),
                    model="torchtitan deepseek_v3 debugmodel, shrunk: first --layers layers, "
                          "--heads MLA heads, scaled-dot-product attention")
    if not args.quiet:
        print(f"train_torchtitan_moe: {args.ranks} ranks, modes {', '.join(args.modes)} (in "
              f"turn, step by step), {args.steps} steps of {args.batch} x {args.seq_len} "
              f"characters per rank; text: {len(text)} characters", file=sys.stderr)
    modes = lm.run_ranks(args, text, trainer=train)
    comparison = compare(modes)
    summarize(modes, comparison)
    if args.report:
        lm.write_report(args.report, {"example": "train_torchtitan_moe", "settings": settings,
                                      "modes": modes, "comparison": comparison})
    return 0


if __name__ == "__main__":
    sys.exit(main())
