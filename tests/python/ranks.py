"""Runs a function on N ranks as real processes joined by torch.distributed (gloo on loopback),
the way torchrun would, and brings back each rank's result or exception. A rank that never
answers fails the test after `timeout` seconds instead of hanging it."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Keel's migration transport (UCX) and gloo stay on loopback.
LOOPBACK_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo"}


class RankFailed(Exception):
    """A rank raised; carries its traceback."""


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
            results: Any) -> None:
    os.environ.update(LOOPBACK_ENV)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
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


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              allow_missing: Optional[List[int]] = None) -> Dict[int, Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` processes; returns rank -> ("ok", value) or
    ("error", (type name, message, traceback)). Ranks in ``allow_missing`` may die silently."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(r, world, port, fn, args, results),
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


def static_config(world: int, experts: int) -> Any:
    """A ``keel.Config`` for ``world`` ranks on one node: the static placement, ``experts //
    world`` persistent slots per rank, no transient slots, UCX for migration."""
    import keel
    return keel.Config.from_dict({
        "topology": {"num_nodes": 1, "gpus_per_node": world},
        "slots": {"persistent_per_rank": experts // world, "transient_per_rank": 0},
        "policy": {"name": "static"}, "migration": {"transport": "ucx"}})
