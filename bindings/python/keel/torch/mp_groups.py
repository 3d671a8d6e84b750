"""Tensor-parallel (MP) groups in keel.torch: the M consecutive ranks of a KeelMoE's group that
hold the same tokens (Megatron's TP group around the MoE layer). Each member dispatches only its
share of the tokens, the engine's rule (``EngineOptions::mp_group_size``): member m of T tokens
takes ``[m * T // M, (m + 1) * T // M)``. Then the members all-gather their combined outputs, so
no (token, k) crosses the all-to-all twice (Parm's de-duplicated dispatch).

Gradients follow tensor parallelism, where every member holds a replica of the activations
around the layer and computes the same loss from them (docs/pytorch.md):

- The output is a replicated activation: the gradient that reaches it is the same on every
  member, and each member takes its own share's rows of it back through the dispatch. The
  all-gather's backward is a slice, not the usual reduce-scatter, which would add the M equal
  replicas and count every token M times.
- The inputs ``hidden`` and ``topk_weights`` are replicated activations: each member computes
  the gradient of its share's rows and the members all-gather them, so every member holds the
  whole gradient, as the replicated layers before it (router, attention) need.

So every (token, k) goes through an expert once per group, forward and backward, and the
experts' gradients summed over the group's members are those of the group's tokens, once.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import numpy
import torch
import torch.distributed as dist

from keel import _checks
from keel._errors import InvalidArgumentError
from keel.torch.routing import to_device

Gather = Callable[[torch.Tensor], torch.Tensor]

# The hidden states' and gate weights' dtypes as numbers, for the members' agreement.
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


class MpGroup:
    """This rank's MP group: ``size`` consecutive ranks of the KeelMoE's group, its ``member``-th.

    Made by :func:`make_mp_group`; ``process_group`` is the torch.distributed group of the
    members (the trainer's own, or one KeelMoE made), ``ranks`` their ranks in the KeelMoE's
    group."""

    def __init__(self, process_group: Any, size: int, member: int, ranks: List[int],
                 made: bool) -> None:
        self.process_group = process_group
        self.size = size
        self.member = member
        self.ranks = ranks
        self.made = made  # KeelMoE made the group, and destroys it on close
        self.backend = str(dist.get_backend(process_group)).lower()

    def share(self, tokens: int, member: Optional[int] = None) -> Tuple[int, int]:
        """The tokens ``[begin, end)`` of ``tokens`` that ``member`` (default: this rank)
        dispatches: the engine's rule."""
        m = self.member if member is None else member
        return tokens * m // self.size, tokens * (m + 1) // self.size

    def gather(self, rows: torch.Tensor, tokens: int,
               wait: Callable[[Any, str], None]) -> torch.Tensor:
        """Every member's share of a ``[tokens, ...]`` tensor, ``rows`` being this member's:
        the whole tensor, in token order. Shares differ by a row at most when M does not divide
        ``tokens``: each is padded to the longest for the all-gather."""
        longest = -(-tokens // self.size)
        if longest == 0:
            return rows.new_empty((0,) + tuple(rows.shape[1:]))
        padded = rows.contiguous()
        if rows.shape[0] < longest:
            padded = torch.cat([padded, rows.new_zeros((longest - rows.shape[0],)
                                                       + tuple(rows.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        wait(dist.all_gather(parts, padded, group=self.process_group, async_op=True),
             "MP group all-gather")
        return torch.cat([part[:end - begin] for part, (begin, end)
                          in zip(parts, (self.share(tokens, m) for m in range(self.size)))])

    def signature(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
        """``[4]`` int64 on the tensors' device: the token count, the dtypes of ``hidden`` and
        ``topk_weights``, and a fingerprint of ``topk_ids`` (the sum of (id + 2) * (entry + 1),
        wrapping around in int64): what the members must agree on before they share the tokens
        out. The values of ``hidden`` and ``topk_weights`` are not compared; that would cost
        an all-gather of the tensors themselves."""
        ids_N = topk_ids.reshape(-1).long()
        position_N = torch.arange(1, ids_N.numel() + 1, device=ids_N.device)
        fingerprint = ((ids_N + 2) * position_N).sum().reshape(1)
        shape = to_device(numpy.array([hidden.shape[0], _DTYPE_CODES[hidden.dtype],
                                       _DTYPE_CODES[topk_weights.dtype]]), ids_N.device)
        return torch.cat([shape, fingerprint])

    def check_signatures(self, layer: int, table: Any) -> None:
        """Raises InvalidArgumentError, on every rank alike, unless the members of every MP group
        agree on their :meth:`signature`. ``table``: ``[ranks of the KeelMoE's group, 4]``."""
        rows = [[int(v) for v in table[r]] for r in range(table.shape[0])]
        names = {code: str(dtype).replace("torch.", "") for dtype, code in _DTYPE_CODES.items()}
        for first in range(0, len(rows), self.size):
            for other in range(first + 1, first + self.size):
                a, b = rows[first], rows[other]
                if a == b:
                    continue
                members = (f"ranks {first} and {other}, members of one MP group (mp_group_size "
                           f"= {self.size}): every member passes the same hidden, topk_ids and "
                           f"topk_weights")
                if a[0] != b[0]:
                    what = f"hidden has {a[0]} tokens on rank {first} and {b[0]} on rank {other}"
                elif a[1] != b[1]:
                    what = (f"hidden is {names[a[1]]} on rank {first} and {names[b[1]]} on rank "
                            f"{other}")
                elif a[2] != b[2]:
                    what = (f"topk_weights is {names[a[2]]} on rank {first} and {names[b[2]]} "
                            f"on rank {other}")
                else:
                    what = f"topk_ids differ between rank {first} and rank {other}"
                raise InvalidArgumentError(f"layer {layer}: {what}; {members}")

    def destroy(self) -> None:
        if self.made:
            dist.destroy_process_group(self.process_group)
            self.made = False


def check_mp_group_size(communicator: Any, size: int, mp_group: Any) -> None:
    """Raises InvalidArgumentError naming ``mp_group_size`` unless MP groups of ``size`` can be
    made over ``communicator``'s group (before any collective: the same verdict on every rank)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgumentError(
            f"mp_group_size = {_checks.shown(size)} is not a positive integer (1: no MP groups)")
    if mp_group is not None and size == 1:
        raise InvalidArgumentError(
            "mp_group is given but mp_group_size = 1: set mp_group_size to the MP group's size")
    if communicator.size % size != 0:
        raise InvalidArgumentError(
            f"mp_group_size = {size} does not divide the group's {communicator.size} ranks")
    if size > 1 and mp_group is None and dist.get_world_size() != communicator.size:
        raise InvalidArgumentError(
            f"mp_group_size = {size} over a group of {communicator.size} of the job's "
            f"{dist.get_world_size()} processes needs mp_group (the members' torch.distributed "
            f"group, e.g. the trainer's tensor-parallel group): torch.distributed.new_group is "
            f"collective over every process of the job, so KeelMoE makes MP groups only over the "
            f"whole job")


def make_mp_group(communicator: Any, size: int, mp_group: Any, device: torch.device,
                  timeout: float) -> Optional[MpGroup]:
    """This rank's MP group of ``size`` consecutive ranks of ``communicator``'s group, or None
    when ``size`` is 1. Collective over that group.

    ``mp_group``: the trainer's torch.distributed group of exactly those members (its TP group),
    or None to make one. ``torch.distributed.new_group`` is collective over every process of the
    job, so KeelMoE makes the groups only when its group is the whole job; over a smaller group
    it needs ``mp_group``. A given ``mp_group`` is checked on every rank and the verdicts are
    exchanged, so that one rank's wrong group fails every rank, not only its own."""
    if size == 1:
        return None
    rank = communicator.rank
    first = rank - rank % size
    ranks = list(range(first, first + size))
    members = communicator.global_ranks[first:first + size]
    if mp_group is not None:
        problem = _mp_group_problem(mp_group, members, size, rank, device)
        verdicts = communicator.all_gather(problem.encode(), timeout)
        for verdict in verdicts:
            if verdict:
                raise InvalidArgumentError(verdict.decode())
        return MpGroup(mp_group, size, rank - first, ranks, made=False)
    backend = dist.get_backend(communicator.group)
    mine = None
    for begin in range(0, communicator.size, size):  # every process makes every group
        group = dist.new_group(communicator.global_ranks[begin:begin + size], backend=backend)
        if begin == first:
            mine = group
    return MpGroup(mine, size, rank - first, ranks, made=True)


def _mp_group_problem(mp_group: Any, members: List[int], size: int, rank: int,
                      device: torch.device) -> str:
    """What is wrong with the trainer's ``mp_group`` on this rank, or ""."""
    if not isinstance(mp_group, dist.ProcessGroup):
        return (f"mp_group on rank {rank} is {type(mp_group).__name__}, not a torch.distributed "
                f"process group that the rank belongs to")
    held = dist.get_process_group_ranks(mp_group)
    if held != members:
        return (f"mp_group on rank {rank} holds the job's ranks {held}; its MP group is the job's "
                f"ranks {members} (mp_group_size = {size} consecutive ranks of KeelMoE's group, "
                f"in order)")
    if str(dist.get_backend(mp_group)).lower() == "nccl" and device.type != "cuda":
        return (f"mp_group on rank {rank} is an NCCL group, but the layer's tensors are on "
                f"{device}")
    return ""


class ShareOf(torch.autograd.Function):
    """Rows ``[begin, end)`` of a ``[tokens, ...]`` tensor every member holds (this member's
    share); backward: the members' share gradients all-gathered, so that every member gets the
    whole gradient of the replicated tensor."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, begin: int, end: int,
                gather: Gather) -> torch.Tensor:
        ctx.gather = gather
        return full[begin:end]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return ctx.gather(grad), None, None, None


class GatherShares(torch.autograd.Function):
    """Every member's share of the output, all-gathered in token order; backward: this member's
    share of the output gradient, which is the same on every member (a replicated activation)."""

    @staticmethod
    def forward(ctx: Any, share: torch.Tensor, begin: int, end: int,
                gather: Gather) -> torch.Tensor:
        ctx.begin, ctx.end = begin, end
        return gather(share)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad[ctx.begin:ctx.end], None, None, None
