"""One layer's routing on the tensors' own device: count the router's choices per expert, hand
the counts to the engine (the only bytes that cross to the host), and turn the engine's quota
table into the dispatch order with torch operations that need no further host round trip.

The rule is the engine's (kernels/remap.h): the entries of expert e, taken in entry order
(token-major, then k), fill e's copies in the quota table's order, copy c taking
``copy_quota[c]`` of them, the last copy the rest. So the slots here equal those of
``Engine.route``, which runs the same rule on the host.

Shapes are in the names: ``T`` tokens, ``K`` choices per token, ``N = T * K`` entries, ``E``
experts, ``C`` copies in this rank's quota table, ``R`` ranks, ``S`` local slots.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import numpy
import torch

from keel._errors import InternalError, InvalidArgumentError
from keel.torch.communicator import wait_for_stream


class ExpertCount(NamedTuple):
    """What :func:`count_experts` started on the device."""

    counts_E: Any       #: [E] int64 on the host
    sorted_N: Any       #: [N] int64: entry indices sorted by expert id, stable; -1 first
    dropped: int        #: entries with id -1 (they sort first)
    extra: Any = None   #: ``count_experts``'s ``extra`` on the host (flattened), or None


def count_experts(topk_ids_TK: torch.Tensor, num_experts: int,
                  timeout: Optional[float] = None,
                  extra: Optional[torch.Tensor] = None) -> ExpertCount:
    """Counts the entries per expert on the ids' device and sorts the entries by expert, then
    brings the counts (and the number of bad ids) to the host in one copy: the layer's one
    device-to-host synchronisation, which raises TimeoutError after ``timeout`` seconds (the
    GPU's queue may hold an earlier all-to-all that waits for a stalled peer). Raises
    InvalidArgumentError naming the first entry that is neither an expert id nor -1, checked
    before any narrowing. ``extra``, a small int64 tensor on the ids' device, comes to the host
    in the same copy (MP groups' agreement on their inputs)."""
    ids_N = topk_ids_TK.reshape(-1)
    # Bin 0 takes the dropped entries (-1) and the bad ids; bins 1..E the experts.
    valid_N = (ids_N >= 0) & (ids_N < num_experts)
    bins_N = torch.where(valid_N, ids_N.long() + 1, 0)
    summary = torch.zeros(num_experts + 2, dtype=torch.int64, device=ids_N.device)
    summary.scatter_add_(0, bins_N, torch.ones_like(bins_N))
    summary[num_experts + 1] = (~valid_N & (ids_N != -1)).sum()
    sorted_N = torch.sort(torch.where(valid_N, ids_N.long(), -1), stable=True)[1]
    if extra is not None:
        summary = torch.cat([summary, extra.reshape(-1)])
    summary = _fetch(summary, timeout)  # the counts are the planner's input
    if int(summary[num_experts + 1]) > 0:
        bad_N = (ids_N < -1) | (ids_N >= num_experts)
        index = int(bad_N.nonzero()[0])
        raise InvalidArgumentError(
            f"topk_ids[{index}] = {int(ids_N[index])} is not an expert id in [0, {num_experts}) "
            f"or -1")
    return ExpertCount(counts_E=summary[1:num_experts + 1], sorted_N=sorted_N,
                       dropped=int(summary[0]),
                       extra=summary[num_experts + 2:] if extra is not None else None)


class Dispatch(NamedTuple):
    """Where each entry goes, on the ids' device."""

    order: Any      #: [rows] int64: the entries in dispatch order (by destination rank, then
                    #: local slot), each slot's entries in entry order
    position: Any   #: [N] int64: each entry's row in that order, ``rows`` for a dropped entry
    slot: Any       #: [N] int32: each entry's physical slot, -1 for a dropped entry


def dispatch_order(count: ExpertCount, copy_begin: Sequence[int], copy_slot: Sequence[int],
                   copy_quota: Sequence[int], slot_key: Any, num_entries: int) -> Dispatch:
    """Assigns every entry its copy from the engine's quota table and orders the entries for
    the all-to-all.

    Args:
        count: this layer's :func:`count_experts`.
        copy_begin, copy_slot, copy_quota: the quota table (``Route.copy_begin``...).
        slot_key: ``[num_slots]`` int64 numpy array: each physical slot's dispatch bucket,
            ``rank * local_slots + local slot``.
        num_entries: N.
    """
    counts_E = count.counts_E.numpy()
    begin = numpy.asarray(copy_begin, dtype=numpy.int64)
    slot_C = numpy.asarray(copy_slot, dtype=numpy.int64)
    quota_C = numpy.asarray(copy_quota, dtype=numpy.int64)
    num_experts = counts_E.shape[0]
    copies_E = numpy.diff(begin)
    stranded = numpy.nonzero((counts_E > 0) & (copies_E == 0))[0]
    if stranded.size > 0:
        raise InternalError(f"the quota table gives expert {int(stranded[0])} no copy for its "
                            f"{int(counts_E[stranded[0]])} entries")
    # Each copy's entries: its quota out of what its expert has left, the last copy the rest.
    expert_C = numpy.repeat(numpy.arange(num_experts), copies_E)
    all_quotas_before_C = numpy.cumsum(quota_C) - quota_C
    quota_before_C = all_quotas_before_C - all_quotas_before_C[begin[expert_C]]
    left_C = numpy.maximum(counts_E[expert_C] - quota_before_C, 0)
    last_C = numpy.zeros(slot_C.size, dtype=bool)
    last_C[begin[1:][copies_E > 0] - 1] = True
    taken_C = numpy.where(last_C, left_C, numpy.minimum(left_C, quota_C))
    # In the expert-sorted entries, copy c's run starts where its expert's entries start plus
    # the quotas of the copies before it; in dispatch order, after every bucket before its own.
    expert_start_E = count.dropped + numpy.cumsum(counts_E) - counts_E
    run_start_C = expert_start_E[expert_C] + quota_before_C
    bucket_C = slot_key[slot_C]
    by_bucket = numpy.argsort(bucket_C, kind="stable")
    dispatch_start_C = numpy.empty_like(taken_C)
    dispatch_start_C[by_bucket] = numpy.cumsum(taken_C[by_bucket]) - taken_C[by_bucket]
    used = taken_C > 0
    table = numpy.stack([run_start_C[used], dispatch_start_C[used], slot_C[used]])

    device = count.sorted_N.device
    sorted_N = count.sorted_N
    rows = num_entries - count.dropped
    table_3U = to_device(table, device)
    # Entry at sorted position p lies in the last run starting at or before p.
    p_rows = torch.arange(count.dropped, num_entries, device=device)
    run_rows = torch.searchsorted(table_3U[0], p_rows, right=True) - 1
    target_rows = table_3U[1][run_rows] + (p_rows - table_3U[0][run_rows])
    entries_rows = sorted_N[count.dropped:]
    order = torch.empty(rows, dtype=torch.int64, device=device)
    order[target_rows] = entries_rows
    position = torch.full((num_entries,), rows, dtype=torch.int64, device=device)
    position[entries_rows] = target_rows
    slot = torch.full((num_entries,), -1, dtype=torch.int32, device=device)
    slot[entries_rows] = table_3U[2][run_rows].to(torch.int32)
    return Dispatch(order=order, position=position, slot=slot)


def slot_major_order(recv_counts_RS: Any, device: Any) -> Any:
    """``[rows]`` int64: the received row of every row in (local slot, source rank) order,
    given ``recv_counts_RS`` (host) rows per (source rank, local slot) in received order
    (source-major), so that each local slot's rows are contiguous for its expert."""
    counts = numpy.asarray(recv_counts_RS, dtype=numpy.int64)
    starts = (numpy.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)
    by_slot_counts = counts.T.reshape(-1)
    block_offsets = numpy.cumsum(by_slot_counts) - by_slot_counts
    shift = starts.T.reshape(-1) - block_offsets
    total = int(by_slot_counts.sum())
    shift_and_count = to_device(numpy.stack([shift, by_slot_counts]), device)
    return (torch.repeat_interleave(shift_and_count[0], shift_and_count[1], output_size=total)
            + torch.arange(total, device=device))


def _fetch(small: torch.Tensor, timeout: Optional[float]) -> torch.Tensor:
    """``small`` on the host, waiting for the device at most ``timeout`` seconds."""
    if small.device.type == "cpu":
        return small
    host = torch.empty(small.shape, dtype=small.dtype, pin_memory=True)
    host.copy_(small, non_blocking=True)
    wait_for_stream(small.device, timeout,
                    lambda: f"the expert counts did not reach the host within {timeout:g} s: "
                            f"the GPU is still waiting for an earlier all-to-all (a peer "
                            f"stalled or died)")
    return host


def to_device(array: Any, device: Any) -> torch.Tensor:
    """A small host int64 array on ``device``. To a GPU through page-locked memory without
    waiting: a plain copy from pageable memory would synchronise torch's stream."""
    host = torch.from_numpy(numpy.ascontiguousarray(array, dtype=numpy.int64))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
