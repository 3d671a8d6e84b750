"""examples/torch/train_moe_pipeline.py at a tiny size: 2 pipeline stages x 2 expert-parallel
ranks, 4 micro-batches in a 1F1B schedule, train what the same micro-batches train without a
pipeline on 2 ranks (the example with one stage: gradient accumulation over the whole model),
under the static and the keel placement (epochs committed on both stages); the report has its
fields; bad flags are refused by name; each stage starts from train_moe_lm.py's weights of its
layers; the schedule's replay gives the textbook 1F1B time.

Tolerance of the losses: relative 1e-6. Every step's loss and the held-out loss have come out
bitwise equal (difference 0.0, both placements): the stages compute the same products on the
same rows, a stage's dense gradients are summed over the same 2 ranks, and each slot's gradient
adds the micro-batches in the same order; only the split of the aux loss's sum over the stages
differs, which leaves its gradients unchanged."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import types
from typing import Any, Dict

import pytest

from ranks import LOOPBACK_ENV, run_ranks, values

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "torch"
EXAMPLE = EXAMPLES / "train_moe_pipeline.py"
TINY = ["--steps", "6", "--layers", "2", "--experts", "8", "--d-model", "16", "--ffn", "32",
        "--heads", "2", "--seq-len", "16", "--batch", "8", "--eval-batches", "2",
        "--micro-batches", "4", "--quiet"]
# The default config's cost model prices these experts' compute below a migration; at a slower
# "GPU" (and a replan every step) the keel mode commits epochs within the run.
CONFIG = """\
topology: {num_nodes: 1, gpus_per_node: 2}
slots: {persistent_per_rank: 5, transient_per_rank: 1}
cost_model: {hidden_size: 16, expert_ffn_size: 32, expert_tflops: 0.000001, dtype_bytes: 4}
policy: {name: keel, replan_interval_steps: 1}
migration: {transport: ucx, deadline_seconds: 60}
engine: {collective_timeout_seconds: 120}
"""
needs_bible = pytest.mark.skipif(shutil.which("bible") is None,
                                 reason="Debian's bible-kjv is not installed (scripts/dev "
                                        "installs it)")
TOLERANCE = 1e-6


def example():
    """The example as a module (its flags, schedule and replay)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_moe_pipeline
    return train_moe_pipeline


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> Dict[str, Any]:
    """The pipelined run (4 processes: 2 stages x 2 ranks) and the unpipelined one (2 processes,
    one stage), both modes each, the same micro-batches of the same batches; the two runs at
    once (their processes spend much of their start waiting for each other)."""
    folder = tmp_path_factory.mktemp("pipeline")
    config = folder / "keel.yaml"
    config.write_text(CONFIG)
    env = dict(os.environ, **LOOPBACK_ENV)
    env.pop("WORLD_SIZE", None)
    runs = {}
    for name, flags in (("pipelined", ["--ranks", "4", "--pipeline-stages", "2"]),
                        ("unpipelined", ["--ranks", "2", "--pipeline-stages", "1"])):
        path = folder / f"{name}.json"
        command = [sys.executable, str(EXAMPLE), *TINY, *flags, "--config", str(config),
                   "--report", str(path)]
        runs[name] = (path, subprocess.Popen(command, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, env=env))
    out = {}
    try:
        for name, (path, process) in runs.items():
            stdout, stderr = process.communicate(timeout=240)
            assert process.returncode == 0, f"{name}: {stdout}\n{stderr}"
            out[name] = json.loads(path.read_text())
            out[name + "_stdout"] = stdout
    finally:
        for _, process in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return out


@needs_bible
@pytest.mark.parametrize("policy", ["static", "keel"])
def test_pipeline_trains_what_accumulation_trains(reports, policy: str) -> None:
    piped = reports["pipelined"]["modes"][policy]
    plain = reports["unpipelined"]["modes"][policy]
    assert len(piped["loss"]) == len(plain["loss"]) == 6
    for step, (got, want) in enumerate(zip(piped["loss"], plain["loss"])):
        assert got == pytest.approx(want, rel=TOLERANCE), f"step {step + 1}"
    assert piped["heldout_loss"] == pytest.approx(plain["heldout_loss"], rel=TOLERANCE)
    if policy == "keel":
        # Placements changed on both stages while micro-batches were in flight.
        assert all(epochs >= 1 for epochs in piped["pipeline"]["stage_epochs"]), piped
        assert plain["epochs"] >= 1
        assert piped["mean_imbalance"] < reports["pipelined"]["modes"]["static"]["mean_imbalance"]


@needs_bible
def test_the_report_has_the_pipeline_fields(reports) -> None:
    report = reports["pipelined"]
    assert report["example"] == "train_moe_pipeline"
    assert report["settings"]["pipeline_stages"] == 2
    assert report["settings"]["micro_batches"] == 4
    assert "1F1B" in report["settings"]["step_time_model"]
    assert "keel / static parallel step:" in reports["pipelined_stdout"]
    assert "bubble" in reports["pipelined_stdout"]
    assert set(report["comparison"]) >= {"parallel_step_ratio", "keel_mean_imbalance",
                                         "heldout_loss_gap", "no_cost_bound",
                                         "replayed_no_cost_bound"}
    assert "no-cost bound, replayed:" in reports["pipelined_stdout"]
    for name, mode in report["modes"].items():
        for key in ("parallel_step_seconds", "expert_seconds", "communication_seconds",
                    "dense_seconds", "control_seconds", "exposed_migration_seconds",
                    "mean_imbalance", "imbalance_per_layer", "loss", "heldout_loss",
                    "tokens_per_second", "epochs", "bytes_moved", "python_overhead_fraction",
                    "pipeline"):
            assert key in mode, f"{name} lacks {key}"
        per_step = mode["parallel_step_seconds"]["per_step"]
        assert len(per_step) == 6 and all(t > 0 for t in per_step)
        assert len(mode["imbalance_per_layer"]) == 2
        pipeline = mode["pipeline"]
        assert pipeline["stages"] == 2 and pipeline["expert_parallel_ranks"] == 2
        assert pipeline["layers"] == [[0, 1], [1, 2]]
        assert pipeline["schedule"] == ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]
        # The critical path's parts add up to the step; the bubble is what the schedule adds
        # to the slowest stage's own work.
        parts = (mode["expert_seconds"] + mode["communication_seconds"] + mode["dense_seconds"]
                 + pipeline["transfer_seconds"] + mode["control_seconds"]
                 + mode["exposed_migration_seconds"])
        assert parts == pytest.approx(mode["parallel_step_seconds"]["mean"], rel=1e-9)
        assert pipeline["bubble_seconds"] >= 0
        assert pipeline["slowest_stage_seconds"] + pipeline["bubble_seconds"] == pytest.approx(
            mode["parallel_step_seconds"]["mean"], rel=1e-9)
        assert max(pipeline["stage_busy_seconds"]) <= pipeline["slowest_stage_seconds"] * 1.0001
        # Experts at their stage's mean over ranks: no operation longer, so no step longer.
        assert 0 < pipeline["balanced_step_seconds"] <= (
            mode["parallel_step_seconds"]["mean"] * (1 + 1e-9))
        assert len(mode["epoch_per_step"]) == 6 and len(mode["epoch_per_step"][0]) == 2


def test_bad_flags_are_refused_by_name(monkeypatch, capsys) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    module = example()

    def refused(flags) -> str:
        with pytest.raises(SystemExit) as exit_:
            module.parse_args(flags)
        assert exit_.value.code == 2, flags
        return capsys.readouterr().err

    assert "--pipeline-stages 3 does not divide the 4 processes (--ranks)" in refused(
        ["--pipeline-stages", "3"])
    assert "--micro-batches 1 is fewer than --pipeline-stages 2" in refused(
        ["--micro-batches", "1"])
    assert "--micro-batches 4 must be >= 1 and divide --batch 10" in refused(["--batch", "10"])
    assert "--save: checkpoints are train_moe_lm.py's" in refused(["--save", "somewhere"])
    assert "--layers 1 is fewer than --pipeline-stages 2" in refused(["--layers", "1"])
    assert "--pipeline-stages must be >= 1, got 0" in refused(["--pipeline-stages", "0"])
    assert "--condense" in refused(["--condense", "0.9"])
    # train_moe_lm.py's own checks still apply.
    assert "--top-k 9 exceeds --experts 8" in refused(["--top-k", "9", "--experts", "8"])
    monkeypatch.setenv("WORLD_SIZE", "6")  # under torchrun the world size counts
    assert "--pipeline-stages 4 does not divide the 6 processes (torchrun's world size)" in (
        refused(["--pipeline-stages", "4", "--micro-batches", "4"]))
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(["--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--pipeline-stages", "--micro-batches", "--ranks", "--batch", "--policy",
                 "--steps", "--aux-loss", "--config", "--report", "--quiet"):
        assert flag in help_text
    assert "--condense" not in help_text
    args = module.parse_args([])
    assert (args.pipeline_stages, args.micro_batches, args.ranks) == (2, 4, 4)


def test_replay_gives_the_1f1b_step() -> None:
    module = example()
    assert module.one_f_one_b(0, 2, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                           ("F", 3), ("B", 2), ("B", 3)]
    assert module.one_f_one_b(1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                           ("B", 2), ("F", 3), ("B", 3)]
    for stages, micro_batches in ((1, 3), (2, 4), (3, 6), (4, 4)):
        schedules = [module.one_f_one_b(s, stages, micro_batches) for s in range(stages)]
        duration = {(s, kind, i): 1.0 if kind == "F" else 2.0
                    for s in range(stages) for kind, i in schedules[s]}
        step, path, ending = module.replay(schedules, duration, [0.5] * stages)
        # Equal stages: (M + S - 1) forward-backward times, then the optimizer (stage 0 last).
        assert step == (micro_batches + stages - 1) * 3.0 + 0.5
        assert ending == 0
        assert sum(duration[op] for op in path) + 0.5 == step
    # A slow last stage: its own work is the step, plus one forward of each earlier stage to
    # fill the pipeline and the earlier stages' backward of the last micro-batch to drain it.
    schedules = [module.one_f_one_b(s, 2, 4) for s in range(2)]
    duration = {(s, kind, i): (1.0 if kind == "F" else 2.0) * (3 if s == 1 else 1)
                for s in range(2) for kind, i in schedules[s]}
    step, _, _ = module.replay(schedules, duration, [0.0, 0.0])
    assert step == 1.0 + 4 * 9.0 + 2.0


def stage_weights(rank: int, world: int) -> Dict[str, Any]:
    """train_moe_lm's model and the stages of a 2- and a 3-stage split of it, built on one rank;
    returns the largest difference of each stage's dense and expert weights from the model's."""
    import torch
    sys.path.insert(0, str(EXAMPLES))
    import train_moe_lm as lm
    import train_moe_pipeline as pipeline

    args = pipeline.parse_args(["--layers", "4", "--experts", "4", "--d-model", "8",
                                "--ffn", "16", "--heads", "2", "--seq-len", "8"])
    vocab = 11
    whole = lm.Mode("static", args, world, vocab)
    want = dict(whole.model.named_parameters())
    differences: Dict[str, float] = {}
    for stages in (2, 3):
        split = [s * args.layers // stages for s in range(stages + 1)]
        for s in range(stages):
            layout = types.SimpleNamespace(ep=1, group=None, layers=range(split[s], split[s + 1]),
                                           first=s == 0, last=s == stages - 1)
            stage = pipeline.PipelineMode("static", args, layout, vocab)
            worst, names = 0.0, 0
            for name, p in stage.model.named_parameters():
                if ".moe." in name:  # the experts: compared below, by logical expert
                    continue
                if name.startswith("blocks."):
                    _, local, rest = name.split(".", 2)
                    name = f"blocks.{int(local) + split[s]}.{rest}"
                worst = max(worst, float((p.detach() - want[name].detach()).abs().max()))
                names += 1
            for local, l in enumerate(layout.layers):
                for got, expected in zip(stage.moe.gather_experts(local),
                                         whole.moe.gather_experts(l)):
                    for key in expected:
                        worst = max(worst, float((got[key] - expected[key]).abs().max()))
            differences[f"{stages} stages, stage {s} ({names} dense tensors)"] = worst
            stage.moe.close()
    whole.moe.close()
    return differences


def test_stages_start_from_the_unpipelined_weights() -> None:
    differences = values(run_ranks(stage_weights, 1, timeout=120))[0]
    assert len(differences) == 5
    for stage, worst in differences.items():
        assert worst == 0.0, f"{stage}: {worst}"
