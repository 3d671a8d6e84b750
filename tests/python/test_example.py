"""examples/torch/train_moe_lm.py end to end at a tiny size: both modes on 4 spawned ranks and
one mode under torchrun, on the KJV text of Debian's bible-kjv; the report has every field the
docs promise, and placement does not change the math."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any, Dict

import pytest

from ranks import LOOPBACK_ENV, free_port

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "torch" / "train_moe_lm.py"
TINY = ["--steps", "4", "--layers", "2", "--experts", "8", "--d-model", "16", "--ffn", "32",
        "--heads", "2", "--seq-len", "16", "--batch", "4", "--eval-batches", "2", "--quiet"]
needs_bible = pytest.mark.skipif(shutil.which("bible") is None,
                                 reason="Debian's bible-kjv is not installed (scripts/dev "
                                        "installs it)")


def run(args, timeout=240):
    env = dict(os.environ, **LOOPBACK_ENV)
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def both_modes(tmp_path_factory) -> Dict[str, Any]:
    """The example's report for both modes at the tiny size (one launch that two tests read),
    with its stdout under the key "stdout"."""
    report_path = tmp_path_factory.mktemp("both") / "torch-demo.json"
    done = run(TINY + ["--report", str(report_path)])
    assert done.returncode == 0, done.stderr
    return dict(json.loads(report_path.read_text()), stdout=done.stdout)


@needs_bible
def test_both_modes_write_the_report(both_modes) -> None:
    report = both_modes
    assert "keel / static parallel step:" in report["stdout"]
    assert set(report["modes"]) == {"static", "keel"}
    for name, mode in report["modes"].items():
        for key in ("parallel_step_seconds", "mean_imbalance", "loss", "heldout_loss",
                    "tokens_per_second", "epochs", "bytes_moved", "expert_seconds",
                    "communication_seconds", "python_overhead_fraction"):
            assert key in mode, f"{name} lacks {key}"
        assert len(mode["parallel_step_seconds"]["per_step"]) == 4
        assert len(mode["loss"]) == 4 and all(0 < x < 10 for x in mode["loss"])
        assert mode["mean_imbalance"] >= 1.0
    static, ours = report["modes"]["static"], report["modes"]["keel"]
    # Same seed, same data, same initial experts: the first step's loss is the same number.
    assert ours["loss"][0] == pytest.approx(static["loss"][0], rel=1e-6)
    assert ours["heldout_loss"] == pytest.approx(static["heldout_loss"], rel=1e-3)
    assert set(report["comparison"]) >= {"parallel_step_ratio", "keel_mean_imbalance",
                                         "heldout_loss_gap", "python_overhead_fraction",
                                         "no_cost_bound", "gap_to_no_cost_bound"}
    # The bound: static's step with its expert time divided by its imbalance.
    bound = (static["expert_seconds"] / static["mean_imbalance"]
             + static["parallel_step_seconds"]["mean"] - static["expert_seconds"])
    assert report["comparison"]["no_cost_bound"] == pytest.approx(
        bound / static["parallel_step_seconds"]["mean"])
    # The BLAS torch ran on: MKL where torch has it built in (PyPI's wheels), else the libblas
    # this process's torch maps (Debian's torch links it).
    import re
    import torch
    if re.search(r"BLAS_INFO=mkl\b", torch.__config__.show()):
        assert report["settings"]["blas"] == "mkl (built into torch)"
    elif os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f if "libblas" in line}
        for library in mapped:
            assert library in report["settings"]["blas"]


@needs_bible
def test_one_mode_under_torchrun(tmp_path) -> None:
    report_path = tmp_path / "keel.json"
    env = dict(os.environ, **LOOPBACK_ENV)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), "--redirects", "2", "--tee", "2", str(EXAMPLE),
         "--policy", "keel", "--report", str(report_path)] + TINY,
        capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert list(report["modes"]) == ["keel"]
    assert report["settings"]["experts"] == 8


@needs_bible
def test_condensation_reports_rows_saved_and_the_loss(tmp_path) -> None:
    report_path = tmp_path / "condense.json"
    done = run(TINY + ["--condense", "0.9", "--report", str(report_path)])
    assert done.returncode == 0, done.stderr
    assert "rows saved by condensation:" in done.stdout
    report = json.loads(report_path.read_text())
    assert list(report["modes"]) == ["keel", "keel+condense"]
    exact, condensed = report["modes"]["keel"], report["modes"]["keel+condense"]
    rows, kept = condensed["condensation_rows"]
    assert rows == exact["condensation_rows"][0] and exact["condensation_rows"][1] == rows
    assert 0 < kept <= rows
    comparison = report["comparison"]
    assert comparison["rows_saved_fraction"] == pytest.approx(1 - kept / rows)
    assert abs(comparison["heldout_loss_difference"]) < 0.05
    # The same first batch through the same weights: condensation changes the loss only a bit.
    assert condensed["loss"][0] == pytest.approx(exact["loss"][0], rel=1e-2)


def example():
    """The example as a module: its flags are checked in this process, without a launch."""
    if str(EXAMPLE.parent) not in sys.path:
        sys.path.insert(0, str(EXAMPLE.parent))
    import train_moe_lm
    return train_moe_lm


def refusal(capsys, argv) -> str:
    """What the example prints when it refuses `argv` (it exits with status 2)."""
    with pytest.raises(SystemExit) as exited:
        example().parse_args(argv)
    assert exited.value.code == 2, argv
    return capsys.readouterr().err


def test_flags_are_checked_and_explained(capsys) -> None:
    help_text = run(["--help"]).stdout
    for flag in ("--aux-loss", "--policy", "--steps", "--report", "--text", "--config",
                 "--condense", "--micro-batches", "--save", "--resume"):
        assert flag in help_text
    assert "--condense must be in (0, 1]" in refusal(capsys, ["--condense", "1.5"])
    assert "--top-k 9 exceeds --experts 8" in refusal(capsys, ["--top-k", "9", "--experts", "8"])
    assert "--micro-batches 3 must be >= 1 and divide --batch 4" in refusal(
        capsys, ["--micro-batches", "3", "--batch", "4"])
    with pytest.raises(SystemExit) as missing:
        example().load_text("/no/such/file.txt")
    assert "--text /no/such/file.txt" in str(missing.value.code)


@needs_bible
def test_micro_batches_save_and_resume_on_fewer_ranks(tmp_path, both_modes) -> None:
    """The same first step with 2 micro-batches as with one batch (the mean of the micro-batches'
    means is the batch's mean); the checkpoint saved on 4 ranks resumes on 2."""
    reports = {"one": both_modes["modes"]["keel"]}
    for name, extra in (("two", ["--micro-batches", "2", "--save", str(tmp_path / "saved")]),
                        ("resumed", ["--ranks", "2", "--resume", str(tmp_path / "saved")])):
        path = tmp_path / f"{name}.json"
        done = run(TINY + ["--policy", "keel", "--report", str(path)] + extra)
        assert done.returncode == 0, name + ": " + done.stderr
        reports[name] = json.loads(path.read_text())["modes"]["keel"]
    one, two, resumed = reports["one"], reports["two"], reports["resumed"]
    assert two["loss"][0] == pytest.approx(one["loss"][0], rel=1e-5)
    assert two["checkpoint"]["bytes"] > 0 and two["checkpoint"]["seconds"] > 0
    assert resumed["resume_seconds"] > 0
    # Trained weights: the resumed run starts below a fresh model's first loss.
    assert resumed["loss"][0] < one["loss"][0] - 0.05, (resumed["loss"], one["loss"])
