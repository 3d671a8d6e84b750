"""atheris target: the keel package's public entry points with hostile arguments.

The input picks an entry point (Config's readers, plan, synthetic_trace, read_trace, replay,
condense_rows, keel.torch.KeelMoE, and the calls of one rank's Engine) and each argument from a
pool of values that have broken argument checks before: wrong types, bools for numbers, ints past
64 bits, NaN and infinities, strings with NUL bytes, deep or self-referencing containers, numpy
and torch values of every dtype and shape. The contract (docs/pytorch.md, "Errors"): a call
returns, or raises a keel.KeelError subclass; anything else (TypeError, AttributeError,
RecursionError, OverflowError, a crash) is a finding. Calls that would write files get a folder
of this process's own.

Run: KEEL_FUZZ_PYTHONPATH=build/python tests/fuzz/run.sh build-fuzz 30 python_api
(or directly: PYTHONPATH=build/python .venv/bin/python tests/fuzz/python_api_fuzz.py -help=1).
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import sys
import tempfile
from typing import Any, Callable, Dict, List

import atheris
import numpy
import torch
import torch._dynamo  # noqa: F401 - imported by keel.torch; loaded here so as not to instrument it
import torch.distributed as dist

with atheris.instrument_imports():
    import keel
    import keel.torch as kt

SCRATCH = tempfile.mkdtemp(prefix="keel-python-fuzz-")
atexit.register(shutil.rmtree, SCRATCH, True)

INTS = [0, 1, 2, 3, -1, 7, 64, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 32 + 1, 2 ** 63 - 1, 2 ** 63,
        2 ** 64, -2 ** 31, -2 ** 63 - 1, 10 ** 30]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1.1, -1.0, 1e308, float("nan"), float("inf"), float("-inf"), 5e-324]
STRINGS = ["", "keel", "static", "eplb", "adam", "auto", "a\0b", "/", ".",
           "\udcff", "x" * 5000, "policy: {name: keel}", "{", "[[[[", "0x10", "1e400",
           "float32", "bfloat16", "cuda", "cpu", "host", "/dev/null", "/no/such/file"]
TENSOR_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32,
                 torch.float64, torch.float16, torch.bfloat16, torch.complex64]


def deep_list(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def self_referencing() -> Any:
    value: List[Any] = [1]
    value.append(value)
    return value


def tensor(data: atheris.FuzzedDataProvider) -> Any:
    dtype = data.PickValueInList(TENSOR_DTYPES)
    dims = data.ConsumeIntInRange(0, 3)
    shape = [data.ConsumeIntInRange(0, 5) for _ in range(dims)]
    numel = math.prod(shape)
    raw = [data.PickValueInList(INTS[:9] + [2 ** 31, 2 ** 40, -2 ** 40]) for _ in range(numel)]
    values = torch.tensor(raw, dtype=torch.int64).reshape(shape) if numel else torch.zeros(shape)
    result = values.to(dtype)
    if data.ConsumeBool() and result.dim() >= 2 and result.shape[1] > 1:
        result = result[:, ::2]  # not contiguous
    return result


def value(data: atheris.FuzzedDataProvider, depth: int = 0) -> Any:
    """One argument from the hostile pool."""
    kind = data.ConsumeIntInRange(0, 17)
    if kind == 0:
        return None
    if kind == 1:
        return data.ConsumeBool()
    if kind == 2:
        return data.PickValueInList(INTS)
    if kind == 3:
        return data.ConsumeInt(8)
    if kind == 4:
        return data.PickValueInList(FLOATS)
    if kind == 5:
        return data.PickValueInList(STRINGS)
    if kind == 6:
        return data.ConsumeUnicodeNoSurrogates(data.ConsumeIntInRange(0, 64))
    if kind == 7:
        return data.ConsumeBytes(data.ConsumeIntInRange(0, 16))
    if kind == 8 and depth < 3:
        return [value(data, depth + 1) for _ in range(data.ConsumeIntInRange(0, 4))]
    if kind == 9 and depth < 3:
        return {data.PickValueInList(STRINGS[:8]): value(data, depth + 1)
                for _ in range(data.ConsumeIntInRange(0, 3))}
    if kind == 10:
        return deep_list(data.PickValueInList([10, 2000, 100000]))
    if kind == 11:
        return self_referencing()
    if kind == 12:
        return tensor(data)
    if kind == 13:
        return numpy.array(data.PickValueInList([0, 1, 2, 3, 7]),
                           dtype=data.PickValueInList([numpy.int64, numpy.int32, numpy.uint64,
                                                       numpy.float32, numpy.bool_]))
    if kind == 14:
        return object()
    if kind == 15:
        return torch.tensor(data.PickValueInList(INTS[:9]))  # a 0-d tensor
    if kind == 16:
        return scratch_path(data)
    return data.PickValueInList([float, int, str, torch.float32, numpy.float64, print])


def scratch_path(data: atheris.FuzzedDataProvider) -> str:
    return os.path.join(SCRATCH, data.PickValueInList(["out", "", "sub/dir", "a\0b", "..",
                                                       "layer-0"]))


def folder(data: atheris.FuzzedDataProvider) -> Any:
    """A folder to write into: this process's own, or a value that is not a usable path."""
    if data.ConsumeBool():
        return scratch_path(data)
    chosen = value(data)
    return chosen if not isinstance(chosen, (str, bytes, os.PathLike)) else ""


def small(data: atheris.FuzzedDataProvider, low: int, high: int) -> Any:
    """Mostly a valid small int (to reach the checks past the first), sometimes hostile."""
    return data.ConsumeIntInRange(low, high) if data.ConsumeIntInRange(0, 3) else value(data)


def one_rank_group() -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with tempfile.NamedTemporaryFile(dir=SCRATCH, delete=False) as rendezvous:
        path = rendezvous.name
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


ENGINE: Dict[str, Any] = {}
TINY_TRACE = keel.synthetic_trace(num_steps=3, num_layers=1, num_experts=4, num_sources=2,
                                  tokens_per_source=16)


def engine() -> Any:
    """One rank's engine (2 layers, 4 experts, top-2, 16-byte experts), made once."""
    if "engine" not in ENGINE:
        ENGINE["engine"] = keel.Engine(kt.ProcessGroupCommunicator(), num_layers=2, num_experts=4,
                                       top_k=2, weight_bytes=16, gradient_bytes=16)
    return ENGINE["engine"]


def call_engine(data: atheris.FuzzedDataProvider) -> None:
    e = engine()
    method = data.ConsumeIntInRange(0, 11)
    if method == 0:
        e.route(small(data, -1, 2), value(data))
    elif method == 1:
        e.route_counts(small(data, -1, 2), value(data))
    elif method == 2:
        e.register_slot(small(data, -1, 2), small(data, -1, 8), value(data), value(data),
                        value(data))
    elif method == 3:
        e.plan_sequences(small(data, -1, 2), value(data), value(data), value(data), value(data),
                         value(data))
    elif method == 4:
        e.placement(value(data))
    elif method == 5:
        e.locate_slot(value(data))
    elif method == 6:
        e.home_slots(value(data))
    elif method == 7:
        e.restore_state(value(data))
    elif method == 8:
        e.save_experts(folder(data))
    elif method == 9:
        e.load_experts(folder(data))
    elif method == 10:
        e.step_end()
    else:
        e.reduce_gradients()


def keel_moe(data: atheris.FuzzedDataProvider) -> None:
    names = ["num_layers", "num_experts", "top_k", "config", "optimizer", "average_gradients",
             "init_expert", "seed", "condense_threshold", "condense_window", "device", "dtype",
             "mp_group_size", "mp_group", "group"]
    kwargs: Dict[str, Any] = {"num_layers": 1, "num_experts": 4, "top_k": 2}
    for _ in range(data.ConsumeIntInRange(1, 3)):
        kwargs[data.PickValueInList(names)] = value(data)
    expert = kt.ffn_expert(4, 8) if data.ConsumeIntInRange(0, 3) else value(data)
    moe = kt.KeelMoE(expert, **kwargs)
    moe.close()


CALLS: List[Callable[[atheris.FuzzedDataProvider], Any]] = [
    lambda d: keel.Config.from_yaml(value(d), value(d)),
    lambda d: keel.Config.from_yaml(d.ConsumeUnicodeNoSurrogates(256)),
    lambda d: keel.Config.from_dict(value(d)),
    lambda d: keel.Config.from_dict({d.PickValueInList(["policy", "slots", "topology",
                                                        "cost_model", "engine"]): value(d)}),
    lambda d: keel.Config.from_file(value(d)),
    lambda d: keel.Config().replace(value(d)),
    lambda d: keel.load_config(value(d)),
    lambda d: keel.plan(value(d), value(d), value(d), value(d), value(d), value(d)),
    lambda d: keel.plan(d.PickValueInList(keel.policy_names()), value(d), small(d, 1, 16),
                        small(d, 1, 4), small(d, 1, 2), small(d, 1, 8)),
    lambda d: keel.synthetic_trace(*[small(d, 1, 8) for _ in range(7)], value(d)),
    lambda d: keel.read_trace(value(d), value(d)),
    lambda d: keel.replay(TINY_TRACE if d.ConsumeBool() else value(d), None,
                          d.PickValueInList([["static"], ["keel", "eplb"], None]) if
                          d.ConsumeBool() else value(d), value(d), value(d)),
    lambda d: keel.condense_rows(value(d), value(d), value(d), value(d)),
    lambda d: kt.ffn_expert(small(d, 1, 8), small(d, 1, 8), value(d)),
    lambda d: kt.ExpertSpec(value(d), value(d), value(d), value(d), value(d)),
    lambda d: kt.ExpertSpec({d.PickValueInList(STRINGS[:8] + [3, None, b"w"]): value(d)}, print,
                            print, small(d, 1, 8), small(d, 1, 8)),
    call_engine,
    keel_moe,
]


def test_one_input(raw: bytes) -> None:
    data = atheris.FuzzedDataProvider(raw)
    call = CALLS[data.ConsumeIntInRange(0, len(CALLS) - 1)]
    try:
        call(data)
    except keel.KeelError:
        pass


def main() -> None:
    one_rank_group()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
