"""The keel package without a trainer: import from the build tree, config reading and errors,
EPLB-shaped planning, traces and replay."""

from __future__ import annotations

import importlib
import os
import pathlib

import numpy
import pytest
import torch

import keel
import keel.torch as kt

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


DEEP: list = []
for _ in range(100_000):
    DEEP = [DEEP]
LOOP: list = [1]
LOOP.append(LOOP)

# Each public call with one bad argument: a KeelError subclass naming the argument (the match),
# never pybind11's TypeError, a path cut at its NUL, or None read as a file named "None".
BAD_CALLS = [
    (lambda: keel.Config.from_file(None), "path must be a path"),
    (lambda: keel.Config.from_file("con\0fig.yaml"), "path = 'con\\\\x00fig.yaml' contains a NUL"),
    (lambda: keel.Config.from_file(""), "path is empty"),
    (lambda: keel.Config.from_yaml(b"policy: {}"), "text must be a str, got bytes"),
    (lambda: keel.Config.from_yaml("{}", source=3), "source must be a str"),
    (lambda: keel.Config.from_dict({"policy": {"name": float("nan")}}), "values cannot be a config"),
    (lambda: keel.Config().replace([("policy", 1)]), "values must be a dict, got list"),
    (lambda: keel.read_trace(None), "path must be a path"),
    (lambda: keel.read_trace("trace.jsonl", format=None), "format must be a str"),
    (lambda: keel.synthetic_trace(num_steps="10"), "num_steps = '10' must be an integer"),
    (lambda: keel.synthetic_trace(num_layers=0), r"num_layers = 0 must be in \[1, "),
    (lambda: keel.synthetic_trace(zipf_exponent=float("inf")), "zipf_exponent = inf must be a finite"),
    (lambda: keel.synthetic_trace(top_k=True), "top_k = True must be an integer"),
    (lambda: keel.replay("synthetic", policies="keel"), "policies must be a list of str"),
    (lambda: keel.replay("synthetic", policies=["keel", 3]), r"policies\[1\] must be a str"),
    (lambda: keel.replay("synthetic", oracle="no"), "oracle = 'no' must be True or False"),
    (lambda: keel.replay("synthetic", config={"policy": {}}), "config must be a keel.Config"),
    (lambda: keel.plan(3, [[1.0, 2.0]], 2), "policy must be a str"),
    (lambda: keel.plan("eplb", [[1.0, 2.0]], 2 ** 40), r"num_replicas = 1099511627776 must be in"),
    (lambda: keel.condense_rows(torch.zeros(2, 2), torch.tensor([0, 2]), "0.5"),
     "threshold = '0.5' must be a number"),
    (lambda: keel.condense_rows(torch.zeros(2, 2), torch.tensor([0, 2]), 1.0, window=0),
     r"window = 0 must be in \[1, "),
    # Found by tests/fuzz/python_api_fuzz.py: values whose repr recurses without end, text that
    # UTF-8 cannot encode, numbers too large for a float, things that only look like arrays.
    (lambda: keel.Config.from_yaml(DEEP), r"text must be a str, got list \[\[\[\[\.\.\.\]\]\]\]"),
    (lambda: keel.Config.from_yaml(LOOP),
     r"text must be a str, got list \[1, \[1, \[1, \[\.\.\.\]\]\]\]"),
    (lambda: keel.Config.from_yaml("a: \udcff"), "text = 'a: \\\\udcff' is not valid Unicode text"),
    (lambda: keel.read_trace("trace\udcff.jsonl"), "path = .* is not valid Unicode text"),
    (lambda: keel.plan("keel", [[10 ** 400, 1.0]], 2), "weight holds a value that is not a number"),
    (lambda: keel.plan("keel", numpy.float64, 2), "weight = .* is not an array of numbers"),
    (lambda: keel.synthetic_trace(zipf_exponent=10 ** 400),
     "zipf_exponent = 1000.* must be a number"),
    (lambda: keel.synthetic_trace(num_steps=torch.tensor([1, 2])),
     "num_steps = tensor.* must be an integer"),
    (lambda: kt.ffn_expert(4, 8, activation=numpy.array([1, 2])), "activation must be a str"),
    (lambda: kt.ffn_expert(4, "8"), "ffn_size = '8' must be an integer"),
    (lambda: kt.ExpertSpec({"w": (4, 0)}, print, print, 4, 4),
     r"shapes\['w'\]\[1\] = 0 must be in"),
    (lambda: kt.ExpertSpec({"w": 4}, print, print, 4, 4), r"shapes\['w'\] = 4 must be a tuple"),
    (lambda: kt.ExpertSpec({"w": (2 ** 20, 2 ** 20)}, print, print, 4, 4),
     "1099511627776 values per expert, more than 17179869184"),
    (lambda: kt.ExpertSpec({"w": (4,)}, 3, print, 4, 4), "forward must be a callable, got int"),
]


@pytest.mark.parametrize("call, message", BAD_CALLS,
                         ids=[f"case{i}" for i in range(len(BAD_CALLS))])
def test_bad_arguments_are_named_by_the_package(call, message) -> None:
    with pytest.raises(keel.InvalidArgumentError, match=message):
        call()


def engine_with_bad_arguments(rank: int, world: int) -> list:
    """The engine's calls on one rank, each with a bad argument: what each raised."""
    import keel.torch as kt
    from ranks import static_config
    communicator = kt.ProcessGroupCommunicator()
    answers = []

    def attempt(call) -> None:
        try:
            call()
            answers.append("accepted")
        except Exception as error:  # noqa: BLE001 - the type is what the test checks
            answers.append(f"{type(error).__name__}: {error}")

    attempt(lambda: keel.Engine(object(), num_layers=1, num_experts=2, top_k=1, weight_bytes=4,
                                gradient_bytes=4))
    attempt(lambda: keel.Engine(communicator, num_layers="1", num_experts=2, top_k=1,
                                weight_bytes=4, gradient_bytes=4))
    attempt(lambda: keel.Engine(communicator, num_layers=1, num_experts=2, top_k=5,
                                weight_bytes=4, gradient_bytes=4))
    engine = keel.Engine(communicator, num_layers=1, num_experts=2, top_k=1, weight_bytes=4,
                         gradient_bytes=4, config=static_config(1, 2))
    attempt(lambda: engine.route(2 ** 40, torch.zeros(3, 1, dtype=torch.int32)))
    attempt(lambda: engine.route("0", torch.zeros(3, 1, dtype=torch.int32)))
    attempt(lambda: engine.placement(None))
    attempt(lambda: engine.locate_slot(1.5))
    attempt(lambda: engine.restore_state(None))
    attempt(lambda: engine.save_experts(None))
    attempt(lambda: engine.load_experts("a\0b"))
    attempt(lambda: engine.register_slot(0, "1", torch.zeros(1), torch.zeros(1)))
    engine.close()
    return answers


def test_engine_calls_name_bad_arguments() -> None:
    from ranks import run_ranks, values
    answers = values(run_ranks(engine_with_bad_arguments, 1, timeout=120))[0]
    expected = ["communicator must have rank, size", "num_layers = '1' must be an integer",
                "top_k = 5 must be in [1, 2]", "layer = 1099511627776 must be in",
                "layer = '0' must be an integer", "layer = None must be an integer",
                "slot = 1.5 must be an integer", "state must be a str, got NoneType",
                "dir must be a path", "dir = 'a\\x00b' contains a NUL",
                "local_slot = '1' must be an integer"]
    assert len(answers) == len(expected)
    for answer, wanted in zip(answers, expected):
        assert answer.startswith("InvalidArgumentError") and wanted in answer, (wanted, answer)


def test_config_dicts_keep_their_numbers_through_replace() -> None:
    """to_dict reads numbers as numbers (YAML 1.2: "1e-06" is a float, "off" a string), so a
    replaced config keeps a small rate, which the library would refuse as a quoted string."""
    config = keel.Config.from_yaml("cost_model: {expert_tflops: 0.000001}\n")
    assert config.to_dict()["cost_model"]["expert_tflops"] == 1e-06
    replaced = config.replace({"policy": {"name": "static"}})
    assert replaced.to_dict()["cost_model"]["expert_tflops"] == 1e-06
    assert replaced.policy == "static"
