"""keel.Engine: one rank's Keel runtime for a Python trainer.

Per step, for every MoE layer and micro-batch: :meth:`Engine.route` (collective) turns the
router's ``topk_ids`` into a physical slot per (token, k) plus the all-to-all splits. After the
last backward,
:meth:`Engine.reduce_gradients` (collective) folds every replica's gradient into its expert's
home; the optimizer then runs on the home slots (:meth:`Engine.home_slots`); afterwards
:meth:`Engine.step_end` (collective) pushes the new weights to the replicas and plans and migrates
the next placement in the background. :mod:`keel.torch` wraps all of this in a dispatcher; use
this class directly to drive your own dispatch.

Buffers are registered by address: the engine reads and writes a slot's tensors in place (also
from its migration thread while forward and backward run), so they must stay alive and at the
same address; the engine keeps a reference to each.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from keel import _checks, _keel
from keel._errors import InvalidArgumentError

# gradient_type -> the torch dtype of its elements.
_GRADIENT_TYPES = {"float32": "float32", "float64": "float64", "fixed_int64": "int64",
                   "bfloat16": "bfloat16", "float16": "float16"}
_MEMORIES = ("host", "cuda")


def _torch() -> Any:
    import torch
    return torch


class Route(NamedTuple):
    """One layer's routing on this rank."""

    slot: Any           #: [num_tokens, top_k] int32: physical slot of each (token, k), -1 dropped
    send_counts: Any    #: [num_ranks] int64: rows this rank sends to each rank (dispatch split)
    recv_counts: Any    #: [num_ranks, local_slots] int64: rows each rank sends to each local slot
    recv_totals: Any    #: [num_ranks] int64: rows received from each rank (combine split)
    local_experts: List[int]  #: [local_slots] expert of each local slot this step, -1 for none
    epoch: int          #: the placement epoch this routing used
    #: The tokens ``[share_begin, share_end)`` this rank routes: all of them, or with MP groups
    #: (``Engine(mp_group_size=M)``) its share of the group's; the others' slots are -1.
    share_begin: int = 0
    share_end: int = 0
    #: This rank's quota table, which ``slot`` was assigned from (include/keel/engine.hpp,
    #: LayerRoute): the copies of expert e are c in ``[copy_begin[e], copy_begin[e + 1])``;
    #: copy c is physical slot ``copy_slot[c]`` and takes ``copy_quota[c]`` of this rank's
    #: entries of e in entry order, the last copy the rest. Lists of int.
    copy_begin: Sequence[int] = ()
    copy_slot: Sequence[int] = ()
    copy_quota: Sequence[int] = ()


class SequencePlacement(NamedTuple):
    """Engine.plan_sequences' answer, the same on every rank: every rank's sequences, rank 0's
    first, each rank's in the order it passed them."""

    origin_rank: Any   #: [sequences] int64: the rank that passed it
    origin_index: Any  #: [sequences] int64: its index in that rank's list
    rank: Any          #: [sequences] int64: the rank that runs it for the planned layers
    used: bool         #: False when no plan paid (then rank == origin_rank)
    moved_sequences: int
    moved_bytes: float      #: one way
    seconds_before: float   #: cost model: expert compute + all-to-all of the planned layers
    seconds_after: float    #: ... with the plan, the moves there and back included


def check_tensor(name: str, tensor: Any, dtypes: Optional[Tuple[Any, ...]],
                 dims: Optional[int] = None,
                 shape: Optional[Tuple[Optional[int], ...]] = None,
                 device: Any = "cpu") -> None:
    """Raises InvalidArgumentError naming `name` unless `tensor` is a torch tensor of one of
    `dtypes` (None: any) with `dims` dimensions (or `shape`, None entries free) on `device`: a
    ``torch.device`` or device string it must be on, ``"cpu"`` (the default: host memory only),
    or None for a CPU or CUDA device."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if dtypes is not None and tensor.dtype not in dtypes:
        expected = " or ".join(_dtype_name(d) for d in dtypes)
        raise InvalidArgumentError(
            f"{name} has dtype {_dtype_name(tensor.dtype)}, expected {expected}")
    if device is None:
        if tensor.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(
                f"{name} is on device {tensor.device}; keel takes CPU or CUDA tensors")
    elif tensor.device != torch.device(device):
        wanted = torch.device(device)
        where = ("host (CPU) tensors only" if wanted.type == "cpu"
                 else f"tensors on {wanted}, like the other arguments of this call")
        raise InvalidArgumentError(f"{name} is on device {tensor.device}; expected {where}")
    if shape is not None:
        dims = len(shape)
    if dims is not None and tensor.dim() != dims:
        raise InvalidArgumentError(
            f"{name} has shape {list(tensor.shape)}, expected {dims} dimensions"
            + (f" {list(shape)}" if shape is not None else ""))
    if shape is not None:
        for axis, (got, want) in enumerate(zip(tensor.shape, shape)):
            if want is not None and got != want:
                raise InvalidArgumentError(
                    f"{name} has shape {list(tensor.shape)}: dimension {axis} is {got}, "
                    f"expected {want}")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def to_int32(name: str, tensor: Any) -> Any:
    """``tensor`` (int32 or int64) as a contiguous int32 tensor; InvalidArgumentError naming the
    first element outside int32's range, which a plain conversion would wrap into another
    (valid-looking) value."""
    torch = _torch()
    if tensor.dtype == torch.int64 and tensor.numel() > 0:
        outside = (tensor < -2 ** 31) | (tensor >= 2 ** 31)
        if bool(outside.any()):
            flat = int(outside.reshape(-1).nonzero()[0])
            index = list(_unravel(flat, tuple(tensor.shape)))
            where = "".join(f"[{i}]" for i in index)
            raise InvalidArgumentError(
                f"{name}{where} = {int(tensor.reshape(-1)[flat])} does not fit in int32")
    return tensor.to(torch.int32).contiguous()


def check_expert_ids(name: str, topk_ids: Any, num_experts: int) -> None:
    """InvalidArgumentError naming the first entry of ``topk_ids`` (flat index) that is neither
    an expert id in ``[0, num_experts)`` nor -1: checked on the ids as given, before any narrowing
    to int32 could turn an id such as 2**32 into a valid one. One reduction on the tensor's
    device; the slow search for the index runs only when there is a bad id."""
    flat = topk_ids.reshape(-1)
    bad = (flat < -1) | (flat >= num_experts)
    if flat.numel() > 0 and bool(bad.any()):
        index = int(bad.nonzero()[0])
        raise InvalidArgumentError(
            f"{name}[{index}] = {int(flat[index])} is not an expert id in [0, {num_experts}) "
            f"or -1")


def _unravel(flat: int, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The index of element ``flat`` of a row-major tensor of ``shape``."""
    index = []
    for size in reversed(shape):
        index.append(flat % size if size else 0)
        flat = flat // size if size else 0
    return tuple(reversed(index))


class Engine:
    """One rank's engine. Collective: every rank creates it with the same config and shapes.

    Args:
        communicator: this rank's collectives: an object with ``rank``, ``size`` and the methods
            of :class:`keel.torch.ProcessGroupCommunicator` (which runs them over a
            ``torch.distributed`` group).
        config: a :class:`keel.Config`, a dict of keys (docs/config.md), or None for the
            defaults with one node of ``communicator.size`` ranks. Its ranks must equal the
            communicator's size. Expert state moves over ``migration.transport`` (``ucx`` for
            ranks in separate processes, bootstrapped over the communicator).
        num_layers, num_experts, top_k: the model's MoE shape.
        weight_bytes: one expert's working weights in bytes (every copy).
        gradient_bytes: one expert's gradient buffer in bytes (every copy).
        optimizer_bytes: a home's optimizer state in bytes (moves with the home); 0 for none.
        gradient_type: element type of gradient buffers: ``float32``, ``float64``,
            ``fixed_int64``, ``bfloat16`` or ``float16`` (16-bit sums add in float32 and
            round once per add).
        mp_group_size: tensor-parallel (MP) groups of this many consecutive ranks, whose
            members hold the same tokens (Parm's de-duplicated dispatch, docs/integration.md):
            every member passes the group's ``topk_ids`` to :meth:`route`, and member ``m =
            rank % M`` routes only tokens ``[m * T / M, (m + 1) * T / M)``; after the combine
            the trainer all-gathers the combined outputs inside the group. Must divide
            ``topology.gpus_per_node``; 1 (the default): no groups.
            ``keel.torch.KeelMoE(mp_group_size=M)`` does all of this for a PyTorch model.
        memory: where the registered slot buffers live: ``"host"`` (CPU tensors) or ``"cuda"``
            (tensors on the CUDA device current when the engine is created; the engine then
            reaches them only through CUDA copies and adds on a stream of its own).
    """

    def __init__(self, communicator: Any, *, config: Any = None, num_layers: int,
                 num_experts: int, top_k: int, weight_bytes: int, gradient_bytes: int,
                 optimizer_bytes: int = 0, gradient_type: str = "float32",
                 mp_group_size: int = 1, memory: str = "host") -> None:
        from keel import Config
        if isinstance(config, dict):
            config = Config.from_dict(config)
        if config is not None and not isinstance(config, Config):
            raise InvalidArgumentError(
                f"config must be a keel.Config, a dict or None, got {type(config).__name__}")
        gradient_type = _checks.text("gradient_type", gradient_type, _GRADIENT_TYPES)
        memory = _checks.text("memory", memory, _MEMORIES)
        for name in ("rank", "size"):
            if not hasattr(communicator, name):
                raise InvalidArgumentError(
                    f"communicator must have rank, size and the collectives of "
                    f"keel.torch.ProcessGroupCommunicator; {type(communicator).__name__} has no "
                    f"{name}")
        num_layers = _checks.integer("num_layers", num_layers, 1, 65536)
        num_experts = _checks.integer("num_experts", num_experts, 1, 65536)
        top_k = _checks.integer("top_k", top_k, 1, num_experts)
        size_t = 2 ** 63 - 1
        weight_bytes = _checks.integer("weight_bytes", weight_bytes, 0, size_t)
        gradient_bytes = _checks.integer("gradient_bytes", gradient_bytes, 0, size_t)
        optimizer_bytes = _checks.integer("optimizer_bytes", optimizer_bytes, 0, size_t)
        mp_group_size = _checks.integer("mp_group_size", mp_group_size, 1, 2 ** 31 - 1)
        self.memory = memory
        torch = _torch()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if memory == "cuda"
                       else torch.device("cpu"))
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.weight_bytes = weight_bytes
        self.gradient_bytes = gradient_bytes
        self.optimizer_bytes = optimizer_bytes
        self.gradient_type = gradient_type
        self.mp_group_size = mp_group_size
        self._native = _keel.Engine(
            communicator, config=config._native if config is not None else None,
            num_layers=num_layers, num_experts=num_experts, top_k=top_k,
            weight_bytes=weight_bytes, gradient_bytes=gradient_bytes,
            optimizer_bytes=optimizer_bytes, gradient_type=gradient_type,
            mp_group_size=mp_group_size, memory=memory)
        self._buffers: Dict[Tuple[int, int], Tuple[Any, ...]] = {}

    # --- shape of this rank ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def num_ranks(self) -> int:
        return self._native.num_ranks

    @property
    def slots_per_rank(self) -> int:
        """Persistent slots per rank and layer: they hold the placement's experts."""
        return self._native.slots_per_rank

    @property
    def transient_per_rank(self) -> int:
        """Transient slots per rank and layer: filled each step with a replica for a burst."""
        return self._native.transient_per_rank

    @property
    def local_slots(self) -> int:
        return self.slots_per_rank + self.transient_per_rank

    @property
    def epoch(self) -> int:
        """The placement epoch in force (the same on every rank)."""
        return self._native.epoch

    # --- buffers --------------------------------------------------------------------------------
    def register_slot(self, layer: int, local_slot: int, weights: Any, gradients: Any,
                      optimizer: Any = None) -> None:
        """Registers this rank's buffers of one slot; every slot of every layer before the first
        route. Local slots ``[0, slots_per_rank)`` are persistent, the rest transient.

        Args:
            weights: contiguous tensor of at least ``weight_bytes`` bytes (any dtype), on the
                engine's device (:attr:`device`: the CPU for ``memory="host"``).
            gradients: contiguous tensor of at least ``gradient_bytes`` bytes, elements of
                ``gradient_type``, on the engine's device.
            optimizer: contiguous tensor of at least ``optimizer_bytes`` bytes for a persistent
                slot (any persistent slot can become a home), on the engine's device; None for
                a transient slot.
        """
        layer = _checks.int32("layer", layer)
        local_slot = _checks.int32("local_slot", local_slot)
        persistent = 0 <= local_slot < self.slots_per_rank
        pointers = []
        for name, tensor, size in (("weights", weights, self.weight_bytes),
                                   ("gradients", gradients, self.gradient_bytes),
                                   ("optimizer", optimizer, self.optimizer_bytes)):
            if tensor is None:
                pointers.append(0)
                continue
            check_tensor(name, tensor, None, device=self.device)
            if not tensor.is_contiguous():
                raise InvalidArgumentError(f"{name} of layer {layer} slot {local_slot} is not "
                                           f"contiguous")
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes < size:
                raise InvalidArgumentError(
                    f"{name} of layer {layer} slot {local_slot} holds {nbytes} bytes, fewer than "
                    f"{name.rstrip('s')}_bytes = {size}")
            pointers.append(tensor.data_ptr())
        expected = _GRADIENT_TYPES[self.gradient_type]
        if gradients is not None and str(gradients.dtype) != f"torch.{expected}":
            raise InvalidArgumentError(
                f"gradients of layer {layer} slot {local_slot} have dtype "
                f"{str(gradients.dtype).replace('torch.', '')}, but gradient_type is "
                f"{self.gradient_type} ({expected} elements)")
        if not persistent and optimizer is not None:
            raise InvalidArgumentError(f"local_slot {local_slot} is transient: it never holds a "
                                       f"home, so it takes no optimizer buffer")
        self._native.register_slot(layer, local_slot, *pointers)
        self._buffers[(layer, local_slot)] = (weights, gradients, optimizer)

    # --- per step -------------------------------------------------------------------------------
    def plan_sequences(self, first_layer: int, tokens: Any, expert_rows: Any,
                       max_token_imbalance: float = 1.10,
                       move_bytes_per_token: float = 0.0,
                       objective: str = "step") -> SequencePlacement:
        """Plans Luffy's sequence migration (docs/luffy.md). Collective: every rank passes its
        own sequences, for the same layers ``[first_layer, first_layer + layers)``.

        Args:
            tokens: ``[sequences]`` int64 CPU tensor, each sequence's tokens.
            expert_rows: ``[sequences, layers, num_experts]`` int32 or int64 CPU tensor, the
                (token, k) rows each sequence sends to each expert in each planned layer.
            max_token_imbalance: no rank ends with more than this times the mean tokens.
            move_bytes_per_token: bytes a token carries when its sequence moves, each way; 0 =
                the cost model's token row.
            objective: what the planner minimises: ``"step"`` (the cost model's step) or
                ``"traffic"`` (summed link time, cross-node bytes weighing most).

        Returns the same :class:`SequencePlacement` on every rank.

        Raises:
            InvalidArgumentError: bad shapes or values here, or on another rank (named).
        """
        torch = _torch()
        first_layer = _checks.int32("first_layer", first_layer)
        max_token_imbalance = _checks.number("max_token_imbalance", max_token_imbalance)
        move_bytes_per_token = _checks.number("move_bytes_per_token", move_bytes_per_token)
        objective = _checks.text("objective", objective)
        check_tensor("tokens", tokens, (torch.int64, torch.int32), dims=1)
        check_tensor("expert_rows", expert_rows, (torch.int32, torch.int64), dims=3)
        if expert_rows.shape[0] != tokens.shape[0] or expert_rows.shape[2] != self.num_experts:
            raise InvalidArgumentError(
                f"expert_rows has shape {list(expert_rows.shape)}, expected "
                f"[{tokens.shape[0]}, layers, {self.num_experts}] (one row per sequence of "
                f"tokens)")
        counts = tokens.to(torch.int64).contiguous()
        rows = to_int32("expert_rows", expert_rows)
        answer = self._native.plan_sequences(first_layer, counts.numel(), counts.data_ptr(),
                                             rows.data_ptr(), rows.shape[1] * rows.shape[2],
                                             max_token_imbalance, move_bytes_per_token, objective)
        return SequencePlacement(
            origin_rank=torch.tensor(answer["origin_rank"], dtype=torch.int64),
            origin_index=torch.tensor(answer["origin_index"], dtype=torch.int64),
            rank=torch.tensor(answer["rank"], dtype=torch.int64),
            used=bool(answer["used"]), moved_sequences=int(answer["moved_sequences"]),
            moved_bytes=float(answer["moved_bytes"]),
            seconds_before=float(answer["seconds_before"]),
            seconds_after=float(answer["seconds_after"]))

    def route(self, layer: int, topk_ids: Any) -> Route:
        """Routes one layer's tokens (one micro-batch of them). Collective: every rank routes the
        same layer at the same time; a layer may be routed once per micro-batch until
        :meth:`reduce_gradients` (docs/integration.md).

        Args:
            topk_ids: ``[num_tokens, top_k]`` int32 or int64 CPU tensor of logical expert ids
                in ``[0, num_experts)``, -1 for a dropped choice. With MP groups: the group's
                tokens, the same on every member.

        Raises:
            InvalidArgumentError: a bad dtype, shape, device or expert id (named by its index).
            DeadlineExceededError / AbortedError: a peer stalled or died.
        """
        torch = _torch()
        layer = _checks.int32("layer", layer)
        check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), shape=(None, self.top_k))
        check_expert_ids("topk_ids", topk_ids, self.num_experts)
        ids = topk_ids.to(torch.int32).contiguous()
        slot = torch.empty(ids.shape, dtype=torch.int32)
        answer = self._native.route(layer, ids.data_ptr(), ids.numel(), slot.data_ptr())
        return self._route(answer, slot)

    def route_counts(self, layer: int, expert_counts: Any) -> Route:
        """Routes one layer from this rank's count of (token, k) entries per expert, for a
        trainer that assigns the slots itself (on the GPU, say) from the returned quota table
        (:attr:`Route.copy_begin`...): everything :meth:`route` returns but ``slot`` (None).
        Collective like :meth:`route`, and one micro-batch like it. With MP groups, count only
        this rank's share of the group's tokens (``share_begin`` and ``share_end`` stay 0), as
        :class:`keel.torch.KeelMoE` does.

        Args:
            expert_counts: ``[num_experts]`` int32 or int64 CPU tensor, each >= 0.
        """
        torch = _torch()
        layer = _checks.int32("layer", layer)
        check_tensor("expert_counts", expert_counts, (torch.int32, torch.int64),
                     shape=(self.num_experts,))
        counts = to_int32("expert_counts", expert_counts)
        answer = self._native.route_counts(layer, counts.data_ptr())
        return self._route(answer, None)

    def _route(self, answer: Dict[str, Any], slot: Any) -> Route:
        torch = _torch()
        return Route(slot=slot,
                     send_counts=torch.tensor(answer["send_counts"], dtype=torch.int64),
                     recv_counts=torch.tensor(answer["recv_counts"], dtype=torch.int64)
                     .reshape(self.num_ranks, self.local_slots),
                     recv_totals=torch.tensor(answer["recv_totals"], dtype=torch.int64),
                     local_experts=list(answer["local_experts"]),
                     epoch=int(answer["epoch"]),
                     share_begin=int(answer["share_begin"]),
                     share_end=int(answer["share_end"]),
                     copy_begin=list(answer["copy_begin"]),
                     copy_slot=list(answer["copy_slot"]),
                     copy_quota=list(answer["copy_quota"]))

    def reduce_gradients(self) -> None:
        """Collective, after backward and before the optimizer: commits a migrated placement
        every rank verified (or discards it), then adds every copy's gradient into its expert's
        home slot in a fixed order."""
        self._native.reduce_gradients()

    def step_end(self) -> None:
        """Collective, after the optimizer updated the homes: copies each home's weights to its
        replicas, feeds the load estimator and plans the next placement in the background."""
        self._native.step_end()

    # --- queries --------------------------------------------------------------------------------
    def home_slots(self, layer: int) -> List[Tuple[int, int]]:
        """``(expert, local_slot)`` of this rank's homes of ``layer``: where the optimizer runs."""
        return [tuple(h) for h in self._native.home_slots(_checks.int32("layer", layer))]

    def placement(self, layer: int) -> Dict[str, Any]:
        """The placement in force (same on every rank): ``phy2log`` ``[num_ranks *
        slots_per_rank]``, ``log2phy`` ``[num_experts, max_copies]``, ``logcnt`` and ``home``
        ``[num_experts]``, as int64 tensors."""
        torch = _torch()
        p = self._native.placement(_checks.int32("layer", layer))
        return {"phy2log": torch.tensor(p["phy2log"], dtype=torch.int64),
                "log2phy": torch.tensor(p["log2phy"], dtype=torch.int64)
                .reshape(p["num_experts"], p["max_copies"]),
                "logcnt": torch.tensor(p["logcnt"], dtype=torch.int64),
                "home": torch.tensor(p["home"], dtype=torch.int64)}

    def locate_slot(self, slot: int) -> Tuple[int, int]:
        """``(rank, local_slot)`` of a physical slot of :attr:`Route.slot`."""
        return tuple(self._native.locate_slot(_checks.int32("slot", slot)))

    def stats(self) -> Dict[str, Any]:
        """What the engine did so far on this rank: steps, epochs committed and aborted, bytes
        moved, seconds in route and control, the last abort's reason."""
        return dict(self._native.stats())

    # --- checkpoints (docs/integration.md, "Checkpoints") ----------------------------------------
    def save_state(self) -> str:
        """The placement in force of every layer, every expert's home and the epoch, as JSON
        text; the same on every rank. A migration in flight is not part of it."""
        return self._native.save_state()

    def restore_state(self, state: str) -> None:
        """Collective, before the first route and before filling the slots: the placement and
        epoch of :meth:`save_state`'s text, from a job of the same shape (same on every rank)."""
        self._native.restore_state(_checks.text("state", state))

    def save_experts(self, dir: str) -> None:
        """Writes every expert whose home is on this rank, by logical id, to
        ``dir/layer-<l>/expert-<e>.bin`` (a header naming the layer, expert and shard, the
        weights, the optimizer state, and a checksum over all of it). Call it on every rank
        right after :meth:`step_end`. An empty ``dir`` or the filesystem root raises
        :class:`keel.InvalidArgumentError`."""
        self._native.save_experts(_checks.path("dir", dir, empty_ok=True))

    def load_experts(self, dir: str) -> None:
        """Fills this rank's registered slots from a :meth:`save_experts` folder under the
        placement in force: every copy its weights, every home its optimizer state. The folder
        may come from another placement or number of ranks. Before the first route. Every file
        is checked before any slot changes: a corrupt, truncated or misplaced file raises
        :class:`keel.InvalidArgumentError` naming the file and the field, and leaves the slots
        as they were."""
        self._native.load_experts(_checks.path("dir", dir, empty_ok=True))

    def close(self) -> None:
        """Cancels a running migration, stops the planner thread and releases the buffers."""
        self._native.close()
        self._buffers.clear()
