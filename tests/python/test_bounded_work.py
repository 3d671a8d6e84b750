"""Work bounded before it starts, through the package: each call below names a job beyond Keel's
limits (docs/config.md, "Limits"), a size or a product of sizes, and must raise
keel.InvalidArgumentError naming the size and the limit before it allocates: within 20 s and
1 GiB more address space than the interpreter had, leaving no file behind. Each case runs in a
process of its own, so that the address-space limit binds that case alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# Inputs a case reads, written by the case's process before the limit is set.
INPUTS = r'''
import json, os

def write(name, text):
    path = os.path.join("inputs", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as out:
        out.write(text)
    return path

def keel_trace_of_sources(sources):
    return write("sources.jsonl", json.dumps(
        {"keel_trace": 1, "num_layers": 1, "num_experts": 1, "num_sources": sources}) + "\n" +
        json.dumps({"step": 0, "layers": [[1] * sources]}) + "\n")

def megatron_of_sparse_ids():
    return write("router_trace_rank0.jsonl", "".join(json.dumps(
        {"step": 10**12 * i, "layer": 1000 * i, "rank": 100 * i, "top_indices": [[65535]]}) + "\n"
        for i in range(20)))

def smartmoe_of_blank_layers():
    write("smartmoe/table_iter0_rank0.log",
          "0:[[" + ",".join(["1"] * 16384) + "]]\n" + "\n" * 60000 + "1:[[1]]\n")
    return os.path.join("inputs", "smartmoe")
'''

# What raises it; then what the message must hold (a regular expression).
CASES = {
    "plan_hot_expert": (
        "keel.plan('eplb', [[10**9] + [1] * 1023], 2 ** 20)",
        r"num_layers x num_experts x \(num_replicas - num_experts \+ 1\), the cells of log2phy "
        r"= 1072694272 is more than the 16777216"),
    "plan_slots_of_all_layers": (
        "keel.plan('keel', [[1.0]] * 64, 2 ** 20)",
        r"num_layers x num_replicas = 67108864 is more than the 16777216"),
    "plan_gpus": (
        "keel.plan('keel', [[1.0] * 8], 16384, num_gpus=16384)",
        r"num_gpus = 16384 is more than the 4096"),
    "synthetic_counts": (
        "keel.synthetic_trace(num_steps=10**6, num_layers=1000)",
        r"counts is more than the 67108864 counts \(512 MiB\) a trace may hold"),
    "synthetic_selections": (
        "keel.synthetic_trace(tokens_per_source=2**31 - 1)",
        r"token selections .* is more than 2\^30"),
    "synthetic_sources": (
        "keel.synthetic_trace(num_sources=16384)",
        r"num_sources 16384 must be in 0\.\.4096"),
    "keel_trace_of_16384_sources": (
        "keel.read_trace(keel_trace_of_sources(16384))",
        r"sources\.jsonl:1: num_sources 16384 is more than 4096"),
    "megatron_sparse_ids": (
        "keel.read_trace(megatron_of_sparse_ids(), format='megatron')",
        r"20 steps of num_layers x num_sources x num_experts = 20 x 20 x 65536 counts, more "
        r"than the 67108864 counts \(512 MiB\) a trace may hold"),
    "smartmoe_blank_layers": (
        "keel.read_trace(smartmoe_of_blank_layers(), format='smartmoe')",
        r"num_layers x num_sources x num_experts = 60002 x 1 x 16384 counts per step"),
    "config_of_65536_ranks": (
        "keel.Config.from_dict({'topology': {'num_nodes': 256, 'gpus_per_node': 256}})",
        r"65536 ranks, more than the 4096 Keel supports"),
    "replay_window_estimator": (
        "keel.replay('synthetic', policies=['static'], config=keel.Config.from_dict("
        "{'topology': {'num_nodes': 512, 'gpus_per_node': 8}, "
        "'estimator': {'kind': 'window', 'window_steps': 10000}}))",
        r"num_layers x ranks x num_experts x \(estimator\.window_steps \+ 1\) = 4 x 4096 x 32 x "
        r"201 load counts, more than the 2\^26"),
    "engine_slots_of_all_layers": (
        "keel.Engine(OneRank(), config={'topology': {'num_nodes': 1, 'gpus_per_node': 1}, "
        "'slots': {'persistent_per_rank': 512, 'transient_per_rank': 0}, "
        "'policy': {'name': 'static'}}, num_layers=65536, num_experts=256, top_k=1, "
        "weight_bytes=4, gradient_bytes=4)",
        r"num_layers x slots per layer \(512\) = 33554432 is more than 16777216"),
    "engine_window_estimator": (
        "keel.Engine(OneRank(), config={'topology': {'num_nodes': 1, 'gpus_per_node': 1}, "
        "'slots': {'persistent_per_rank': 4096, 'transient_per_rank': 0}, "
        "'policy': {'name': 'static'}, 'estimator': {'kind': 'window', 'window_steps': 1000}}, "
        "num_layers=64, num_experts=4096, top_k=1, weight_bytes=4, gradient_bytes=4)",
        r"num_layers x ranks x num_experts x \(estimator\.window_steps \+ 1\) = 64 x 1 x 4096 x "
        r"1001 load counts, more than the 2\^26"),
}

# The case's process: inputs written, then the address space capped at what it has plus 1 GiB.
CHILD = INPUTS + r'''
import resource, sys
import keel
if "Engine" in sys.argv[1]:
    import torch  # the engine's wrapper needs it; loaded before the cap

class OneRank:
    """A communicator of one rank: the engine refuses the shape before any collective."""
    rank = 0
    size = 1

call = compile(sys.argv[1], "<case>", "eval")
with open("/proc/self/status") as status:
    size_kb = int(status.read().split("VmSize:")[1].split()[0])
cap = size_kb * 1024 + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
try:
    eval(call, globals())
except keel.InvalidArgumentError as error:
    print("refused:", error)
    sys.exit(0)
print("accepted")
sys.exit(1)
'''


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_job_beyond_the_limits_is_refused_before_it_starts(name: str, tmp_path) -> None:
    code, message = CASES[name]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # The case runs elsewhere: the package's folder by its absolute path.
    path = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    environment = dict(os.environ, TMPDIR=str(scratch), PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run([sys.executable, "-c", CHILD, code], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert done.stdout.startswith("refused: "), done.stdout
    assert re.search(message, done.stdout), done.stdout
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if not str(p.relative_to(tmp_path)).startswith("inputs"))
    assert left == ["tmp"], left
