"""Keel's collectives over the trainer's own ``torch.distributed`` process group.

The engine calls these methods from the thread that calls it (route, reduce_gradients,
step_end), with the collective's deadline in seconds. Every operation is posted asynchronously and
waited for with that deadline, so a stalled peer becomes a ``TimeoutError`` (the engine's
DEADLINE_EXCEEDED) and a dead one the backend's error (ABORTED), never a hang. Sums are folded in
rank order, so every rank gets the same bits on every run. Gloo runs on CPU tensors; an NCCL group
runs the same code on the current CUDA device, and moves the engine's GPU slot buffers device to
device (:meth:`ProcessGroupCommunicator.all_to_all_v_device`).

On an NCCL group the deadline is kept on the host by polling the collective's completion
(:func:`wait_until`): NCCL's own ``work.wait(timeout)`` would sleep a millisecond between checks,
which costs a millisecond on every collective.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from keel import _checks
from keel._errors import FailedPreconditionError, InvalidArgumentError

_DTYPES = {"int64": torch.int64, "float64": torch.float64}


class ProcessGroupCommunicator:
    """The collectives a :class:`keel.Engine` needs, over ``group`` (default: the whole world).

    Args:
        group: a process group of ``torch.distributed`` (initialized by the trainer), or None for
            ``torch.distributed.group.WORLD``.
    """

    name = "torch.distributed"

    def __init__(self, group: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise FailedPreconditionError(
                "torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(...) before creating keel's engine")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise InvalidArgumentError(
                f"group = {_checks.shown(group)} ({type(group).__name__}) is not a "
                f"torch.distributed process group (None: the whole job)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank: int = dist.get_rank(self.group)
        self.size: int = dist.get_world_size(self.group)
        if self.rank < 0:
            raise InvalidArgumentError("this process is not a member of the given group")
        self.backend = str(dist.get_backend(self.group)).lower()
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.backend == "nccl" else torch.device("cpu"))
        # An NCCL group exchanges GPU slot buffers without staging them in host memory; a gloo
        # group's engine stages them (gloo would copy CUDA tensors through the host anyway).
        self.moves_device_memory = self.backend == "nccl"
        # Broadcast names its root by global rank; the group's members tell theirs (public API
        # on every torch version).
        me = torch.tensor([dist.get_rank()], dtype=torch.int64, device=self.device)
        self._global_ranks = [int(r) for r in self._gather(me, 0, "rank exchange")]

    @property
    def global_ranks(self) -> List[int]:
        """Each member's rank in the job (``torch.distributed.get_rank()``), in group order."""
        return list(self._global_ranks)

    # --- helpers ------------------------------------------------------------------------------
    def _wait(self, work: Any, timeout: float, what: str) -> None:
        if self.moves_device_memory:
            work.wait()  # torch's current stream waits for the collective; the host does not
            wait_until(work.is_completed, timeout, lambda: self._late(what, timeout))
            return
        if timeout is None or timeout <= 0:
            work.wait()
            return
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as error:
            if "timed out" in str(error).lower():
                raise TimeoutError(self._late(what, timeout)) from None
            raise

    def _late(self, what: str, timeout: float) -> str:
        return (f"{what} did not complete within {timeout:g} s on rank {self.rank} of "
                f"{self.size}: a peer stalled or died")

    def _gather(self, tensor: Any, timeout: float, what: str) -> List[Any]:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, tensor, group=self.group, async_op=True), timeout, what)
        return parts

    def _bytes_tensor(self, data: Any) -> Any:
        """``data`` (bytes or a memoryview the engine lends for the call) as a uint8 tensor on
        the group's device, without a copy on the CPU."""
        if len(data) == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        if isinstance(data, bytes):
            data = bytearray(data)
        return torch.frombuffer(data, dtype=torch.uint8).to(self.device)

    # --- the collectives ------------------------------------------------------------------------
    def all_gather(self, mine: bytes, timeout: float) -> List[bytes]:
        """Every rank's bytes, in rank order."""
        length = torch.tensor([len(mine)], dtype=torch.int64, device=self.device)
        lengths = [int(n) for n in self._gather(length, timeout, "all_gather (lengths)")]
        longest = max(lengths)
        if longest == 0:  # gloo cannot gather empty tensors
            return [b""] * self.size
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:len(mine)] = self._bytes_tensor(mine)
        parts = self._gather(padded, timeout, "all_gather")
        return [part[:n].cpu().numpy().tobytes() for part, n in zip(parts, lengths)]

    def barrier(self, timeout: float) -> None:
        self._wait(dist.barrier(group=self.group, async_op=True), timeout, "barrier")

    def all_reduce(self, values: memoryview, dtype: str, op: str, timeout: float) -> None:
        """Reduces ``values`` (int64 or float64, in place) over the ranks: sum, min or max; sums
        are folded in rank order so that every rank and run gets the same bits."""
        local = torch.frombuffer(values, dtype=_DTYPES[dtype])
        if local.numel() == 0:
            return
        parts = self._gather(local.to(self.device), timeout, f"all_reduce ({op})")
        result = parts[0].clone()
        for part in parts[1:]:
            if op == "sum":
                result += part
            elif op == "min":
                result = torch.minimum(result, part)
            elif op == "max":
                result = torch.maximum(result, part)
            else:
                raise InvalidArgumentError(f"op = {op!r} is not sum, min or max")
        local.copy_(result.cpu())

    def broadcast(self, data: bytes, root: int, timeout: float) -> bytes:
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        source = self._global_ranks[root]
        self._wait(dist.broadcast(length, source, group=self.group, async_op=True), timeout,
                   "broadcast (length)")
        payload = (self._bytes_tensor(data) if self.rank == root
                   else torch.empty(int(length), dtype=torch.uint8, device=self.device))
        if payload.numel() > 0:  # the same on every rank: the length was broadcast
            self._wait(dist.broadcast(payload, source, group=self.group, async_op=True), timeout,
                       "broadcast")
        return payload.cpu().numpy().tobytes()

    def all_to_all_v_known(self, send: memoryview, send_bytes: Sequence[int], recv: memoryview,
                           recv_bytes: Sequence[int], timeout: float) -> None:
        """Sends ``send_bytes[r]`` bytes of ``send`` to each rank r and writes what every rank
        sends here into ``recv``, ``recv_bytes[r]`` from rank r in rank order: the sizes are
        known on both sides (the engine derives them from one plan), so no collective exchanges
        them. On gloo the bytes go straight between the engine's buffers."""
        payload = self._bytes_tensor(send)
        if self.device.type == "cpu":
            received = (torch.frombuffer(recv, dtype=torch.uint8) if len(recv) > 0
                        else torch.empty(0, dtype=torch.uint8))
        else:
            received = torch.empty(len(recv), dtype=torch.uint8, device=self.device)
        self._wait(dist.all_to_all_single(received, payload, list(recv_bytes), list(send_bytes),
                                          group=self.group, async_op=True),
                   timeout, "all_to_all_v")
        if self.device.type != "cpu" and len(recv) > 0:
            torch.frombuffer(recv, dtype=torch.uint8).copy_(received.cpu())

    def all_to_all_v_device(self, send: int, send_bytes: Sequence[int], recv: int,
                            recv_bytes: Sequence[int], timeout: float) -> None:
        """The same over GPU memory at the addresses ``send`` and ``recv`` (the engine's slot
        exchange buffers on this rank's device), device to device through the group (NCCL).
        Returns when ``recv`` holds the bytes (the collective has completed): the engine reads
        them next on a stream of its own."""
        payload = _device_bytes(send, sum(send_bytes), self.device)
        received = _device_bytes(recv, sum(recv_bytes), self.device)
        self._wait(dist.all_to_all_single(received, payload, list(recv_bytes), list(send_bytes),
                                          group=self.group, async_op=True),
                   timeout, "all_to_all_v (device)")

    def all_to_all_v(self, send: memoryview, send_bytes: Sequence[int],
                     timeout: float) -> Tuple[Any, List[int]]:
        """Sends ``send_bytes[r]`` bytes of ``send`` (back to back in rank order) to each rank r;
        returns what every rank sent here (a uint8 array) and how many bytes came from each."""
        counts = torch.tensor(list(send_bytes), dtype=torch.int64, device=self.device)
        recv_counts = torch.empty_like(counts)
        self._wait(dist.all_to_all_single(recv_counts, counts, group=self.group, async_op=True),
                   timeout, "all_to_all_v (sizes)")
        recv_bytes = [int(n) for n in recv_counts.cpu()]
        payload = self._bytes_tensor(send)
        received = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=self.device)
        # Every rank takes part, also one that sends and receives nothing.
        self._wait(dist.all_to_all_single(received, payload, recv_bytes, list(send_bytes),
                                          group=self.group, async_op=True),
                   timeout, "all_to_all_v")
        return received.cpu().numpy(), recv_bytes


def wait_until(done: Callable[[], bool], timeout: Optional[float],
               message: Callable[[], str]) -> None:
    """Returns once ``done()`` is true; raises ``TimeoutError(message())`` if that takes longer
    than ``timeout`` seconds (None or <= 0: no limit). Checks without pause for the first
    millisecond, then every 50 microseconds: GPU work usually ends within microseconds of the
    first check, and a spinning thread must not starve the others for long."""
    if done():
        return
    started = time.monotonic()
    deadline = started + timeout if timeout is not None and timeout > 0 else None
    while not done():
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise TimeoutError(message())
        if now - started > 1e-3:
            time.sleep(50e-6)


def wait_for_stream(device: Any, timeout: Optional[float], message: Callable[[], str]) -> None:
    """Waits (:func:`wait_until`) for the work queued so far on ``device``'s current stream."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    wait_until(done.query, timeout, message)


class _CudaBytes:
    """``size`` bytes of CUDA memory at ``address``, as the CUDA array interface describes them,
    so that ``torch.as_tensor`` wraps them without a copy."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (address, False), "version": 2}


def _device_bytes(address: int, size: int, device: Any) -> Any:
    """A uint8 tensor over ``size`` bytes of the engine's memory on ``device`` (no copy)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.as_tensor(_CudaBytes(address, size), device=device)
