"""Runs a function on N ranks as real processes joined by torch.distributed (gloo on loopback,
or NCCL), the way torchrun would, and brings back each rank's result or exception. A rank that
never answers fails the test after `timeout` seconds instead of hanging it.

Devices: keel.torch's tests run on every device in ``DEVICES`` (pytest parameters): ``cpu``,
and ``cuda`` where torch sees a GPU (else that case is skipped with the reason). Set
``KEEL_TEST_DEVICE=cuda`` (or ``cpu``) to run one device's cases only, as the GPU check does.
gloo ranks share the one GPU; an NCCL group needs a GPU per rank."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Keel's migration transport (UCX) and gloo stay on loopback.
LOOPBACK_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo"}


class RankFailed(Exception):
    """A rank raised; carries its traceback."""


def _device_cases() -> List[Any]:
    only = os.environ.get("KEEL_TEST_DEVICE", "")
    cases = []
    for device in ("cpu", "cuda"):
        if only and device != only:
            continue
        marks = []
        if device == "cuda" and not torch.cuda.is_available():
            marks.append(pytest.mark.skip(reason="torch sees no CUDA device on this machine"))
        cases.append(pytest.param(device, marks=marks, id=device))
    return cases


DEVICES = _device_cases()


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
            results: Any, backend: str, device: str, environment: Dict[str, str]) -> None:
    # A forkserver child starts with the server's environment: take the test's, as spawn would.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(LOOPBACK_ENV)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        if device == "cuda":
            # gloo ranks share the GPUs round robin; NCCL needs one GPU per rank.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        # Plain pickle: tensors travel by value, not as shared memory that dies with the rank.
        results.put(pickle.dumps((rank, "ok", fn(rank, world, *args))))
    except BaseException as error:  # noqa: B036 - everything goes back to the test
        results.put(pickle.dumps(
            (rank, "error", (type(error).__name__, str(error), traceback.format_exc()))))
    finally:
        # Flush the answer, then leave without waiting for peers: a test may have killed one.
        results.close()
        results.join_thread()
        os._exit(0)


def _rank_context() -> Any:
    """Ranks start from a fork server that has imported torch and keel once per test process,
    not each rank (about 1.5 s of CPU per rank saved). Its children are fresh, single-threaded
    processes, as spawn's are: no thread, CUDA context or process group is inherited."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "keel", "keel.torch"])
    return context


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              allow_missing: Optional[List[int]] = None, backend: str = "gloo",
              device: str = "cpu") -> Dict[int, Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` processes joined by ``backend``, with
    ``device`` ("cpu" or "cuda") current; returns rank -> ("ok", value) or ("error", (type
    name, message, traceback)). Ranks in ``allow_missing`` may die silently."""
    context = _rank_context()
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker,
                                 args=(r, world, port, fn, args, results, backend, device,
                                       dict(os.environ)),
                                 daemon=True) for r in range(world)]
    for p in processes:
        p.start()
    answers: Dict[int, Any] = {}
    expected = set(range(world)) - set(allow_missing or [])
    deadline = time.monotonic() + timeout
    try:
        while not expected.issubset(answers):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(expected - set(answers))
                raise TimeoutError(f"ranks {missing} did not answer within {timeout} s")
            try:
                rank, status, value = pickle.loads(results.get(timeout=min(left, 1.0)))
            except queue.Empty:
                continue
            answers[rank] = (status, value)
    finally:
        for rank, p in enumerate(processes):
            if rank in answers:  # it is on its way out
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return answers


def values(answers: Dict[int, Any]) -> List[Any]:
    """Every rank's value in rank order; raises RankFailed with the first rank's traceback."""
    out = []
    for rank in sorted(answers):
        status, value = answers[rank]
        if status != "ok":
            raise RankFailed(f"rank {rank} raised {value[0]}: {value[1]}\n{value[2]}")
        out.append(value)
    return out


def expect_error(messages: List[str], kind: type, call: Callable[[], Any]) -> None:
    """Calls ``call`` and appends the message of the ``kind`` it raised to ``messages``, or a note
    that it raised none (which the test's expected messages then fail on)."""
    try:
        call()
    except kind as error:
        messages.append(str(error))
    else:
        messages.append(f"NO ERROR from {call}")


def static_config(world: int, experts: int) -> Any:
    """A ``keel.Config`` for ``world`` ranks on one node: the static placement, ``experts //
    world`` persistent slots per rank, no transient slots, UCX for migration."""
    import keel
    return keel.Config.from_dict({
        "topology": {"num_nodes": 1, "gpus_per_node": world},
        "slots": {"persistent_per_rank": experts // world, "transient_per_rank": 0},
        "policy": {"name": "static"}, "migration": {"transport": "ucx"}})
