#!/usr/bin/env python3
"""keel.integrations.megatron on the lent GPU: Megatron-Core's own MoELayer (alltoall token
dispatcher, TopKRouter with its auxiliary loss, SequentialMLP experts) against the same layer
with Keel inside, from the same weights, on 2 ranks that share the GPU (gloo with CUDA tensors:
NCCL takes one GPU per rank), every tensor on the GPU, with Megatron's CUDA code as it is.

It runs the cases of tests/python/test_megatron.py (static and keel placement with replicas in
use, dropless and with a capacity, 3 SGD steps each) through that file's own functions with
device "cuda", and asserts what it asserts: outputs, input gradients, router gradients and every
expert's gradient within its TOLERANCE, and the parameter bookkeeping (Keel's slots outside the
model's parameters, Megatron's optimizer groups and its DistributedDataParallel's buffers; the
replicas folded into the homes and refreshed after the step). On the CPU the same file runs in
CI with megatron_on_cpu.py's answers to Megatron's CUDA calls; here none of them is answered, but
for the name megatron-core 0.16.1 leaves undefined without Transformer Engine.

megatron-core comes from the wheel bench/gpu/pack.sh carries (.gpu-deps/wheels), unpacked onto
PYTHONPATH by bench/gpu/torch_check.sh. Writes the largest differences as JSON to --json.

Usage: megatron_check.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(root, "tests", "python"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the largest differences here")
    args = parser.parse_args()
    import torch
    import megatron.core
    from ranks import run_ranks, values
    import test_megatron

    if not torch.cuda.is_available():
        print("megatron_check.py: torch sees no CUDA device")
        return 1
    print("megatron-core", megatron.core.__version__, "torch", torch.__version__, flush=True)
    started = time.monotonic()
    worst = test_megatron.check_answers(
        values(run_ranks(test_megatron.run_all, test_megatron.RANKS, "cuda", timeout=400,
                         device="cuda")))
    report = {"megatron_core": megatron.core.__version__, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0), "ranks": test_megatron.RANKS,
              "cases": [list(case) for case in test_megatron.CASES],
              "largest_relative_differences": worst, "tolerance": test_megatron.TOLERANCE,
              "seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    print("megatron_check.py: equal within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
