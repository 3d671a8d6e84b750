"""The keel package without a trainer: import from the build tree, config reading and errors,
EPLB-shaped planning, traces and replay."""

from __future__ import annotations

import importlib
import os
import pathlib

import pytest
import torch

import keel

SHARED = pathlib.Path(os.environ.get("KEEL_SHARED_TRACES", "../shared/traces"))


def test_imports_from_the_build_tree() -> None:
    build = os.environ.get("KEEL_BUILD_DIR")
    if build:
        assert pathlib.Path(keel.__file__).resolve().is_relative_to(pathlib.Path(build).resolve())
    assert keel.__version__.count(".") == 2
    assert importlib.import_module("keel.torch").KeelMoE  # the trainer-facing half imports too


def test_config_round_trips_and_names_bad_keys_with_their_line(tmp_path) -> None:
    config = keel.Config.from_dict({"policy": {"name": "static"},
                                    "topology": {"num_nodes": 2, "gpus_per_node": 4}})
    assert config.policy == "static" and config.num_ranks == 8
    assert keel.Config.from_yaml(config.to_yaml()) == config
    assert config.replace({"policy": {"name": "keel"}}).policy == "keel"
    assert config.to_dict()["topology"]["gpus_per_node"] == 4
    path = tmp_path / "bad.yaml"
    path.write_text("policy:\n  name: keel\n  replan_interval_steps: -3\n")
    with pytest.raises(keel.InvalidArgumentError) as error:
        keel.load_config(str(path))
    assert f"{path}:3" in str(error.value) and "replan_interval_steps" in str(error.value)
    assert "-3" in str(error.value)
    with pytest.raises(keel.InvalidArgumentError, match=r"<dict>:\d+: unknown key 'polcy'"):
        keel.Config.from_dict({"polcy": {"name": "keel"}})
    with pytest.raises(FileNotFoundError):
        keel.Config.from_file(str(tmp_path / "missing.yaml"))
    assert "policy.name" in keel.Config.reference()


def test_plan_answers_like_eplb() -> None:
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]])
    phy2log, log2phy, logcnt = keel.plan("eplb", weight, num_replicas=16, num_groups=4,
                                         num_nodes=2, num_gpus=8)
    # DeepSeek EPLB's own example (its README) and the counts vLLM's test asserts.
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]]
    assert phy2log.dtype == torch.int64 and log2phy.shape == (1, 12, 2)
    for e in range(12):
        slots = [s for s in log2phy[0, e].tolist() if s >= 0]
        assert len(slots) == logcnt[0, e] and all(phy2log[0, s] == e for s in slots)
    for policy in keel.policy_names():
        phy2log, _, logcnt = keel.plan(policy, weight, 16, 4, 2, 8)
        assert phy2log.shape == (1, 16) and int(logcnt.sum()) == int((phy2log >= 0).sum())
    with pytest.raises(keel.InvalidArgumentError, match="num_replicas 10 is not divisible by "
                                                        "num_gpus 4"):
        keel.plan("eplb", weight, 10, 1, 1, 4)
    with pytest.raises(keel.InvalidArgumentError, match=r"weight\[0\]\[2\] = -1"):
        keel.plan("keel", [[1.0, 2.0, -1.0, 4.0]], 4, 1, 1, 4)
    with pytest.raises(keel.InvalidArgumentError, match="roundrobin"):
        keel.plan("roundrobin", weight, 16, 4, 2, 8)
    with pytest.raises(keel.InvalidArgumentError, match="num_gpus = 8.0 must be an integer"):
        keel.plan("eplb", weight, 16, 4, 2, 8.0)
    counts = torch.tensor([16, 4, 2, 8])  # tensor and numpy integers are integers too
    assert keel.plan("eplb", weight.numpy(), *counts.tolist())[0].tolist() == \
        keel.plan("eplb", weight, *counts)[0].tolist()


def test_synthetic_trace_replays_into_a_report() -> None:
    trace = keel.synthetic_trace(seed=3, num_steps=30, num_layers=2, num_experts=16,
                                 num_sources=4)
    counts = trace.counts()
    assert counts.shape == (30, 2, 4, 16)
    # Every source routes tokens_per_source x top_k choices per step and layer.
    assert torch.all(counts.sum(dim=3) == 4096 * 2)
    report = keel.replay(trace, policies=["static", "keel"])
    assert set(report["policies"]) == {"static", "keel"}
    static, ours = report["policies"]["static"], report["policies"]["keel"]
    assert ours["imbalance"]["mean"] < static["imbalance"]["mean"]
    assert len(ours["series"]["step_imbalance"]) == 30
    again = keel.replay(trace, policies=["static", "keel"])
    assert again["policies"]["keel"]["imbalance"] == ours["imbalance"]  # deterministic


def test_trace_errors_name_the_path() -> None:
    with pytest.raises(keel.NotFoundError, match="no/such/trace"):
        keel.read_trace("no/such/trace.jsonl")
    with pytest.raises(keel.InvalidArgumentError, match="format"):
        keel.read_trace("x.jsonl", format="csv")


@pytest.mark.skipif(not (SHARED / "smartmoe-ae").exists(), reason="shared traces not present")
def test_reads_a_recorded_trace() -> None:
    trace = keel.read_trace(str(SHARED / "smartmoe-ae" / "moe_trace.tar.xz"))
    assert (trace.num_layers, trace.num_experts, trace.num_sources) == (24, 32, 16)
    assert trace.num_steps == 501


def test_int64_values_that_do_not_fit_int32_are_named_not_wrapped() -> None:
    """Every int64 argument the package narrows to int32 (route counts, sequence rows, bucket
    bounds) is checked first: 2**32 would wrap to 0, a valid-looking value."""
    with pytest.raises(keel.InvalidArgumentError,
                       match=r"bucket_begin\[1\] = 4294967296 does not fit in int32"):
        keel.condense_rows(torch.zeros(3, 4), torch.tensor([0, 2 ** 32]), 1.0, 8)
    with pytest.raises(keel.InvalidArgumentError,
                       match=r"expert_rows\[1\]\[0\]\[2\] = -2147483649 does not fit in int32"):
        keel.to_int32("expert_rows", torch.tensor([[[0, 0, 0]], [[0, 0, -2 ** 31 - 1]]]))
    narrowed = keel.to_int32("expert_counts", torch.tensor([0, 2 ** 31 - 1, -2 ** 31]))
    assert narrowed.dtype == torch.int32
    assert narrowed.tolist() == [0, 2 ** 31 - 1, -2 ** 31]
