"""KeelMoE: Keel for the MoE layers of a PyTorch model.

One :class:`keel.Engine` serves every MoE layer. Each layer's :class:`MoEDispatcher`
(keel/torch/dispatcher.py) takes the router's output and dispatches it through the engine's
slots. Expert weights live in per-slot parameters whose memory the engine owns by address; the
optimizer hooks (:meth:`KeelMoE.attach`) fold replica gradients into the homes before
``optimizer.step()`` and push the homes' new weights to the replicas after it; checkpoints hold
the experts by logical id (:meth:`KeelMoE.state_dict`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import numpy
import torch
import torch.distributed as dist

from keel import _checks
from keel._errors import FailedPreconditionError, InternalError, InvalidArgumentError
from keel.engine import Engine
from keel.torch.communicator import ProcessGroupCommunicator, wait_for_stream
from keel.torch.dispatcher import MoEDispatcher, StepTimes
from keel.torch.experts import ExpertSpec
from keel.torch.mp_groups import MpGroup, check_mp_group_size, make_mp_group


class KeelMoE:
    """Keel for every MoE layer of one model: the engine over a ``torch.distributed`` group, one
    :class:`MoEDispatcher` per layer (:meth:`layer`), and the optimizer hooks (:meth:`attach`).

    Collective: every rank of the group creates it with the same arguments.

    Args:
        expert: the expert's parameters and computation (:func:`keel.torch.ffn_expert`).
        num_layers, num_experts, top_k: the model's MoE shape.
        group: the ``torch.distributed`` group whose ranks hold the experts (default: world).
        config: a :class:`keel.Config` or a dict of keys (docs/config.md); its ranks must equal
            the group's size. None: the defaults with one node of the group's ranks.
            Expert state moves between processes over ``migration.transport: ucx``, which
            connects through the group; set it unless the config already names it.
        optimizer: the optimizer state a home carries: ``"adam"`` (torch.optim.Adam or AdamW:
            step, exp_avg, exp_avg_sq per parameter) or ``"none"`` (SGD without momentum).
        average_gradients: divide each home's summed gradient by the number of data-parallel
            replicas, the group's size over ``mp_group_size``, as DistributedDataParallel
            averages dense gradients.
        init_expert: ``init_expert(layer, expert) -> params`` gives an expert's initial
            parameters (the same on every rank); default: ``expert.init`` seeded by ``seed``,
            layer and expert.
        seed: seeds the default initialization.
        condense_threshold: > 0 turns on Luffy's token condensation (docs/luffy.md): rows of one
            slot that are identical, or (below 1.0) whose cosine is at least this, are sent and
            computed once in the forward. 1.0 condenses only repeated rows and trains as without
            it; lower values change the math. ``condensation_rows`` counts [rows, rows kept].
        condense_window: rows before a row in its slot that it is compared with.
        device: where the experts' slots live and the layer's tensors come from: the CPU or a
            CUDA device. Default: this rank's current CUDA device for an NCCL group, else the
            CPU. A gloo group takes CUDA tensors too (several ranks may share one GPU).
        dtype: the expert parameters' dtype (and their gradients' and Adam moments'): float32,
            bfloat16 or float16. Hidden states may have another of these dtypes: the experts
            compute in the hidden states' dtype, so float32 parameters with bfloat16 hidden
            states train with float32 master weights, as ``torch.autocast`` does.
        mp_group_size: tensor-parallel (MP) groups of this many consecutive ranks of ``group``
            (``[g * M, (g + 1) * M)``, the engine's rule) whose members pass the same tokens,
            router output and gate weights to every layer: each member dispatches only its share
            of the tokens and the members all-gather the outputs (keel/torch/mp_groups.py has
            the gradients). Must divide the group's size and ``topology.gpus_per_node``.
            1: no groups.
        mp_group: the members' ``torch.distributed`` group (the trainer's tensor-parallel
            group), exactly this rank's MP group in rank order; None: KeelMoE makes the groups,
            which needs ``group`` to be the whole job (``new_group`` is collective over every
            process).
    """

    _OPTIMIZERS = ("adam", "none")
    _DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

    def __init__(self, expert: ExpertSpec, *, num_layers: int, num_experts: int, top_k: int,
                 group: Any = None, config: Any = None, optimizer: str = "adam",
                 average_gradients: bool = True,
                 init_expert: Optional[Callable[[int, int], Dict[str, torch.Tensor]]] = None,
                 seed: int = 0, condense_threshold: float = 0.0,
                 condense_window: int = 32, device: Any = None,
                 dtype: torch.dtype = torch.float32, mp_group_size: int = 1,
                 mp_group: Any = None) -> None:
        if not isinstance(expert, ExpertSpec):
            raise InvalidArgumentError(
                f"expert must be a keel.torch.ExpertSpec, got {type(expert).__name__}")
        optimizer = _checks.text("optimizer", optimizer, self._OPTIMIZERS)
        condense_threshold = _checks.number("condense_threshold", condense_threshold, 0.0, 1.0)
        condense_window = _checks.integer("condense_window", condense_window, 1, 2 ** 31 - 1)
        average_gradients = _checks.flag("average_gradients", average_gradients)
        seed = _checks.integer("seed", seed)
        if init_expert is not None and not callable(init_expert):
            raise InvalidArgumentError(
                f"init_expert must be None or a callable, got {type(init_expert).__name__}")
        if not isinstance(dtype, torch.dtype) or dtype not in self._DTYPES:
            raise InvalidArgumentError(
                f"dtype = {_checks.shown(dtype)} is not one of "
                f"{', '.join(str(d) for d in self._DTYPES)}")
        self.condense_threshold = float(condense_threshold)
        self.condense_window = int(condense_window)
        self.condensation_rows = [0, 0]  # forward rows dispatched, rows sent after condensation
        self.spec = expert
        self.optimizer_kind = optimizer
        self.dtype = dtype
        self.element_size = torch.empty(0, dtype=dtype).element_size()
        # Adam: a float32 step, then exp_avg and exp_avg_sq in the parameters' dtype, per
        # parameter, packed per slot (4-byte aligned throughout: 2 moments of 2-byte elements).
        self.optimizer_bytes = (sum(4 + 2 * count * self.element_size
                                    for _, count in expert.offsets.values())
                                if optimizer == "adam" else 0)
        self.average_gradients = average_gradients
        self.seed = seed
        self._init_expert = init_expert
        self.communicator = ProcessGroupCommunicator(group)
        self.group = self.communicator.group
        check_mp_group_size(self.communicator, mp_group_size, mp_group)
        self.mp_group_size = mp_group_size
        self.device = self._choose_device(device)
        if self.condense_threshold > 0 and (self.device.type != "cpu" or dtype != torch.float32):
            raise InvalidArgumentError(
                f"condense_threshold = {condense_threshold} needs float32 experts on the CPU; "
                f"these are {self._DTYPES[dtype]} on {self.device}")
        if isinstance(config, dict):
            from keel import Config
            config = Config.from_dict(config)
        slot_bytes = expert.numel * self.element_size
        with _current_cuda_device(self.device):
            self.engine = Engine(self.communicator, config=config, num_layers=num_layers,
                                 num_experts=num_experts, top_k=top_k, weight_bytes=slot_bytes,
                                 gradient_bytes=slot_bytes, optimizer_bytes=self.optimizer_bytes,
                                 gradient_type=self._DTYPES[dtype],
                                 mp_group_size=mp_group_size,
                                 memory="cuda" if self.device.type == "cuda" else "host")
        self.collective_timeout = _collective_timeout(config)
        try:
            self.mp: Optional[MpGroup] = make_mp_group(self.communicator, mp_group_size,
                                                       mp_group, self.device,
                                                       self.collective_timeout)
        except BaseException:
            self.engine.close()
            raise
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        # Physical slot -> dispatch bucket: rank * local_slots + local slot.
        engine = self.engine
        num_physical = engine.num_ranks * engine.local_slots
        keys = [0] * num_physical
        for slot in range(num_physical):
            owner, local = engine.locate_slot(slot)
            keys[slot] = owner * engine.local_slots + local
        self.slot_keys = numpy.asarray(keys, dtype=numpy.int64)
        self.times: Optional[StepTimes] = None
        self.layers = [MoEDispatcher(self, layer) for layer in range(num_layers)]
        self._reduced = False
        self._optimizers: List[Any] = []

    def _choose_device(self, device: Any) -> torch.device:
        if device is None:
            return self.communicator.device
        try:
            chosen = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise InvalidArgumentError(
                f"device = {_checks.shown(device)} is not a torch device") from None
        if chosen.type == "cuda":
            if not torch.cuda.is_available():
                raise InvalidArgumentError(
                    f"device = {_checks.shown(device)}, but torch sees no CUDA device")
            if chosen.index is None:
                chosen = torch.device("cuda", torch.cuda.current_device())
        elif chosen.type != "cpu":
            raise InvalidArgumentError(
                f"device = {_checks.shown(device)}: keel takes CPU or CUDA devices")
        return chosen

    def synchronize(self, what: str = "the work queued on the GPU") -> None:
        """Waits for the work torch queued on this device: the engine's copies and sums run on
        a stream of their own, so what torch's stream wrote must be there first. Within the
        collective deadline: that work includes the layers' all-to-alls, which a stalled peer
        holds up."""
        if self.device.type != "cuda":
            return
        wait_for_stream(self.device, self.collective_timeout,
                        lambda: f"{what} did not finish within {self.collective_timeout:g} s on "
                                f"rank {self.engine.rank}: a layer's all-to-all is waiting for a "
                                f"peer that stalled or died")

    # --- pieces for the model -------------------------------------------------------------------
    def layer(self, index: int) -> MoEDispatcher:
        """The dispatcher (a ``torch.nn.Module``) of MoE layer ``index``."""
        if not 0 <= index < self.num_layers:
            raise InvalidArgumentError(f"layer = {index} is not in [0, {self.num_layers})")
        return self.layers[index]

    def parameters(self) -> List[torch.nn.Parameter]:
        """Every slot parameter of every layer (persistent and transient)."""
        return [p for layer in self.layers for p in layer.parameters()]

    def initial_expert(self, layer: int, expert: int) -> Dict[str, torch.Tensor]:
        """Expert ``expert`` of ``layer`` before training: the same on every rank."""
        if self._init_expert is not None:
            return self._init_expert(layer, expert)
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + layer * 65_537 + expert) % (2 ** 63))
        return self.spec.init(generator)

    # --- communication --------------------------------------------------------------------------
    def exchange(self, layer: int) -> Callable[[torch.Tensor, List[int], List[int]], torch.Tensor]:
        """The all-to-all of ``layer``'s rows over the group, with the collective deadline."""

        def run(rows: torch.Tensor, send: List[int], recv: List[int]) -> torch.Tensor:
            started, started_thread = time.process_time(), time.thread_time()
            out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
            self._wait(dist.all_to_all_single(out, rows.contiguous(), recv, send,
                                              group=self.group, async_op=True),
                       f"layer {layer} all-to-all")
            if self.times is not None:
                self.times.communication[layer] += time.process_time() - started
                self.times.exchange_thread += time.thread_time() - started_thread
            return out

        return run

    def gather_shares(self, layer: int, tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The all-gather of ``layer``'s shares of ``tokens`` rows inside this rank's MP group,
        with the collective deadline."""
        mp = self.mp
        assert mp is not None

        def run(rows: torch.Tensor) -> torch.Tensor:
            started, started_thread = time.process_time(), time.thread_time()
            out = mp.gather(rows, tokens,
                            lambda work, what: self._wait(work, f"layer {layer} {what}"))
            if self.times is not None:
                self.times.communication[layer] += time.process_time() - started
                self.times.exchange_thread += time.thread_time() - started_thread
            return out

        return run

    def _wait(self, work: Any, what: str) -> None:
        """Waits for a layer's collective ``work``. NCCL: only torch's stream waits, so the GPU
        runs on while Python queues the next work; a stalled peer shows at the next wait with a
        deadline (the next count's fetch, the optimizer hooks). Else within the deadline."""
        if self.communicator.moves_device_memory:
            work.wait()
        else:
            self.communicator._wait(work, self.collective_timeout, what)

    # --- the optimizer --------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Installs Keel's hooks on ``optimizer``: before ``step()`` :meth:`reduce_gradients`
        (unless called already, e.g. before gradient clipping), after it :meth:`step_end`.

        The optimizer must hold every persistent slot's parameters (e.g. built over
        ``model.parameters()``), in groups with the same hyper-parameters, since any slot can
        become any expert's home. With ``optimizer="adam"`` it must be ``torch.optim.Adam`` or
        ``AdamW`` (amsgrad off); each slot's Adam state then lives in the buffer the engine moves
        with a home, so a home that moves keeps its state.
        """
        if self._optimizers:
            raise FailedPreconditionError(
                f"KeelMoE is already attached to {type(self._optimizers[0]).__name__} "
                f"({'the same optimizer' if optimizer is self._optimizers[0] else 'another one'}"
                f" now): its hooks would fold and push twice per step; attach one optimizer, "
                f"once")
        in_optimizer = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        settings = None
        for layer in self.layers:
            for local, slot in enumerate(layer.slots):
                if local >= self.engine.slots_per_rank:
                    continue
                for name, param in slot.items():
                    group = in_optimizer.get(id(param))
                    if group is None:
                        raise InvalidArgumentError(
                            f"the optimizer does not hold layer {layer.layer} slot {local}'s "
                            f"parameter {name!r}: build it over model.parameters() (or "
                            f"KeelMoE.parameters())")
                    mine = {k: v for k, v in group.items() if k != "params"}
                    if settings is None:
                        settings = mine
                    elif mine != settings:
                        raise InvalidArgumentError(
                            "the optimizer holds Keel's slots in param groups with different "
                            f"settings ({settings} and {mine}); any slot can become any "
                            "expert's home, so they need one setting")
        if self.optimizer_kind == "adam":
            if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                raise InvalidArgumentError(
                    f"optimizer is {type(optimizer).__name__}, but KeelMoE was created with "
                    f"optimizer='adam' (torch.optim.Adam or AdamW)")
            if settings and settings.get("amsgrad"):
                raise InvalidArgumentError("amsgrad=True is not supported: Keel moves exp_avg "
                                           "and exp_avg_sq with a home, not max_exp_avg_sq")
            if (self.device.type == "cuda" and settings
                    and not (settings.get("fused") or settings.get("capturable"))):
                # The step counts live on the GPU, in the buffer that moves with a home; torch's
                # default Adam reads each one back to the host (a synchronisation per parameter).
                warnings.warn("Adam over Keel's CUDA slots runs fastest with fused=True (or "
                              "capturable=True): the step counts live on the GPU",
                              stacklevel=2)
            self._install_adam_views(optimizer)
            # The optimizer's own state dict leaves Keel's slots out: their Adam state is by
            # physical slot, which another placement does not share, and their number depends
            # on the ranks; it travels by logical expert in optimizer_state_dict(). Loading one
            # (saved under any placement or rank count) gives the slots their places back and
            # puts the views back.
            optimizer.register_state_dict_post_hook(self._drop_slot_state)
            optimizer.register_load_state_dict_pre_hook(self._fit_slot_state)
            optimizer.register_load_state_dict_post_hook(self._install_adam_views)
        optimizer.register_step_pre_hook(lambda *_: self.reduce_gradients())
        optimizer.register_step_post_hook(lambda *_: self.step_end())
        self._optimizers.append(optimizer)

    def _slot_parameters(self) -> List[torch.nn.Parameter]:
        """Every persistent slot's parameters, the ones the optimizer holds."""
        return [param for layer in self.layers
                for local in range(self.engine.slots_per_rank)
                for param in layer.slots[local].values()]

    def _install_adam_views(self, optimizer: torch.optim.Optimizer) -> None:
        for layer in self.layers:
            for local in range(self.engine.slots_per_rank):
                views = layer.optimizer_state_views(local)
                for name, param in layer.slots[local].items():
                    optimizer.state[param] = dict(views[name])

    def _drop_slot_state(self, optimizer: torch.optim.Optimizer,
                         state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """``state_dict`` (the optimizer's, packed by parameter index) without Keel's slot
        parameters: neither their state nor their places in the param groups (nor their names,
        in a group that has ``param_names``)."""
        slots = {id(p) for p in self._slot_parameters()}
        ours = set()
        groups = []
        for group, packed in zip(optimizer.param_groups, state_dict["param_groups"]):
            pairs = list(zip(group["params"], packed["params"]))
            ours.update(index for param, index in pairs if id(param) in slots)
            kept = {**packed, "params": [i for p, i in pairs if id(p) not in slots]}
            if "param_names" in packed:  # torch keeps them beside the params, index for index
                kept["param_names"] = [name for p, name in zip(group["params"],
                                                               packed["param_names"])
                                       if id(p) not in slots]
            groups.append(kept)
        state_dict["param_groups"] = groups
        state_dict["state"] = {index: value for index, value in state_dict["state"].items()
                               if index not in ours}
        return state_dict

    def _fit_slot_state(self, optimizer: torch.optim.Optimizer,
                        state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """A saved optimizer state dict made to fit this optimizer: each group's saved indices
        go to its other parameters in order, Keel's slot parameters get indices of their own
        with no state (their Adam state comes from load_optimizer_state_dict; the post-hook puts
        the views back). A dict saved with the slots in it (as many parameters per group) keeps
        its places, without the slots' state."""
        slots = {id(p) for p in self._slot_parameters()}
        taken = {i for packed in state_dict["param_groups"] for i in packed["params"]}
        fresh = max(taken | set(state_dict["state"]), default=-1) + 1
        ours, groups = set(), []
        for g, (group, packed) in enumerate(zip(optimizer.param_groups,
                                                state_dict["param_groups"])):
            if len(packed["params"]) == len(group["params"]):
                ours.update(i for p, i in zip(group["params"], packed["params"])
                            if id(p) in slots)
                groups.append(packed)
                continue
            others = sum(1 for p in group["params"] if id(p) not in slots)
            if len(packed["params"]) != others:
                raise InvalidArgumentError(
                    f"the optimizer state dict's param group {g} has {len(packed['params'])} "
                    f"parameters besides Keel's slots; this optimizer's has {others}")
            saved = iter(packed["params"])
            saved_names = iter(packed.get("param_names", ()))
            names = group.get("param_names", [None] * len(group["params"]))
            params, param_names = [], []
            for param, name in zip(group["params"], names):
                if id(param) in slots:
                    params.append(fresh)
                    param_names.append(name)
                    ours.add(fresh)
                    fresh += 1
                else:
                    params.append(next(saved))
                    param_names.append(next(saved_names, None))
            fitted = {**packed, "params": params}
            if "param_names" in packed:
                fitted["param_names"] = param_names
            groups.append(fitted)
        return {**state_dict, "param_groups": groups,
                "state": {i: v for i, v in state_dict["state"].items() if i not in ours}}

    # --- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The experts' weights by logical expert: ``layers.{l}.experts.{e}.{name}`` for every
        expert with a persistent copy on this rank (views of its home or of its first copy;
        replicas equal their home after ``step_end``). The same entries a model's
        ``state_dict()`` has under each dispatcher's prefix. Together, the ranks' dicts hold
        every expert; ``torch.distributed.checkpoint`` saves each key once."""
        out: Dict[str, torch.Tensor] = {}
        for layer in self.layers:
            out.update(layer.state_dict(prefix=f"layers.{layer.layer}."))
        return out

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Fills every persistent copy of each expert this rank holds, under the placement in
        force, from ``state`` (:meth:`state_dict`'s keys; it may come from another placement,
        another number of ranks, or a plain model's experts renamed to these keys). Every layer
        is checked first: a missing entry (with ``strict``), an unknown expert or parameter, or
        a wrong shape or dtype raises :class:`keel.InvalidArgumentError` naming the keys, and
        nothing is changed. Collective only in that every rank should load."""
        problems = []
        for layer in self.layers:
            _, missing, unexpected, errors = layer.expert_entries(state, f"layers.{layer.layer}.")
            problems += errors + [f"{key}: not a layer's expert parameter" for key in unexpected]
            if strict:
                problems += [f"{key}: missing" for key in missing]
        known = tuple(f"layers.{layer.layer}.experts." for layer in self.layers)
        problems += [f"{key}: not a key of KeelMoE.state_dict()" for key in state
                     if not key.startswith(known)]
        if problems:
            raise InvalidArgumentError("the experts' checkpoint does not fit; nothing was "
                                       "loaded: " + "; ".join(problems[:8])
                                       + (f"; and {len(problems) - 8} more" if len(problems) > 8
                                          else ""))
        for layer in self.layers:
            prefix = f"layers.{layer.layer}."
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                   if k.startswith(prefix)}, strict=strict)

    def _adam_views(self) -> Dict[str, torch.Tensor]:
        """``layers.{l}.experts.{e}.{name}.{step|exp_avg|exp_avg_sq}`` -> the view of that
        value in this rank's home slots."""
        if self.optimizer_kind != "adam":
            raise FailedPreconditionError(
                f"KeelMoE was created with optimizer={self.optimizer_kind!r}: its homes carry no "
                f"Adam state to save or load")
        out = {}
        for layer in self.layers:
            for expert, local in sorted(layer._moe.engine.home_slots(layer.layer)):
                for name, fields in layer.optimizer_state_views(local).items():
                    for field, view in fields.items():
                        out[f"layers.{layer.layer}.experts.{expert}.{name}.{field}"] = view
        return out

    def optimizer_state_dict(self) -> Dict[str, torch.Tensor]:
        """The Adam state of the experts whose home is on this rank, by logical expert
        (``layers.{l}.experts.{e}.{name}.step``, ``.exp_avg``, ``.exp_avg_sq``; views of the
        buffers the engine moves with a home). The optimizer's own ``state_dict()`` leaves
        Keel's slots out; save both."""
        return dict(self._adam_views())

    def load_optimizer_state_dict(self, state: Dict[str, Any]) -> None:
        """Fills the Adam state of every home on this rank, under the placement in force, from
        ``state`` (:meth:`optimizer_state_dict`'s keys, from any placement or rank count; the
        entries of experts homed elsewhere are skipped). Every entry is checked first: a home's
        entry missing, or a shape or dtype that differs, raises
        :class:`keel.InvalidArgumentError` naming the keys, and nothing is changed."""
        views = self._adam_views()
        problems = [f"{key}: missing" for key in views if key not in state]
        for key, view in views.items():
            value = state.get(key)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                problems.append(f"{key}: expected a floating-point tensor, got "
                                f"{getattr(value, 'dtype', type(value).__name__)}")
            elif tuple(value.shape) != tuple(view.shape):
                problems.append(f"{key}: shape {list(value.shape)} in the checkpoint, "
                                f"{list(view.shape)} in the model")
        if problems:
            raise InvalidArgumentError("the experts' optimizer state does not fit; nothing was "
                                       "loaded: " + "; ".join(problems[:8])
                                       + (f"; and {len(problems) - 8} more" if len(problems) > 8
                                          else ""))
        with torch.no_grad():
            for key, view in views.items():
                view.copy_(state[key])
        self.synchronize("loading the experts' optimizer state")

    def reduce_gradients(self) -> None:
        """Collective, after backward and before the optimizer (the hook calls it; call it
        yourself before clipping gradients): every replica's gradient is added into its expert's
        home in a fixed order, averaged over the group when ``average_gradients``; non-home
        slots get ``.grad = None`` so that the optimizer skips them. A placement whose
        migration every rank verified is committed here."""
        if self._reduced:
            return
        started = time.process_time()
        for layer in self.layers:
            layer.collect_gradients()
        self.synchronize("backward")
        self.engine.reduce_gradients()
        # Over the data-parallel replicas: an MP group's members hold one replica's tokens.
        replicas = self.engine.num_ranks // self.mp_group_size
        scale = 1.0 / replicas if self.average_gradients else 1.0
        for layer in self.layers:
            layer.keep_home_gradients(scale)
        self._reduced = True
        if self.times is not None:
            self.times.control += time.process_time() - started

    def step_end(self) -> None:
        """Collective, after the optimizer: pushes each home's new weights to its replicas, plans
        the next placement in the background, and clears every slot parameter's ``.grad`` for
        the next backward."""
        if not self._reduced:
            raise FailedPreconditionError(
                "step_end before reduce_gradients: the optimizer ran on unreduced gradients")
        started = time.process_time()
        self.synchronize("the optimizer step")
        self.engine.step_end()
        for layer in self.layers:
            layer.attach_gradients()
            layer.end_step()
        self._reduced = False
        if self.times is not None:
            self.times.control += time.process_time() - started

    def end_forward_pass(self) -> None:
        """Collective, optional: ends the engine's step after forward-only passes (evaluation,
        no backward, no optimizer) so that their traffic counts as a step of its own; without it
        it counts toward the next training step. Nothing is reduced or updated; the passes'
        routing feeds the load estimator, as real traffic should."""
        if self._reduced:
            raise FailedPreconditionError(
                "end_forward_pass after reduce_gradients: finish the training step with "
                "optimizer.step() (or step_end())")
        self.synchronize("the forward pass")
        self.engine.step_end()
        for layer in self.layers:
            layer.end_step()

    # --- results --------------------------------------------------------------------------------
    def gather_experts(self, layer: int) -> List[Dict[str, torch.Tensor]]:
        """Collective: every expert's weights of ``layer`` from its home, on every rank
        (``[num_experts]`` of name -> tensor on this rank's device)."""
        mine = {e: {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
                for e, params in self.layers[layer].home_parameters().items()}
        everyone: List[Any] = [None] * self.engine.num_ranks
        dist.all_gather_object(everyone, mine, group=self.group)
        experts: List[Optional[Dict[str, torch.Tensor]]] = [None] * self.num_experts
        for part in everyone:
            for e, params in part.items():
                experts[e] = params
        missing = [e for e, p in enumerate(experts) if p is None]
        if missing:
            raise InternalError(f"layer {layer}: experts {missing} have no home")
        experts = [{n: t.to(self.device) for n, t in params.items()} for params in experts]
        return experts  # type: ignore[return-value]

    def stats(self) -> Dict[str, Any]:
        """The engine's counters on this rank (epochs, bytes moved, ...)."""
        return self.engine.stats()

    def close(self) -> None:
        """Stops the engine's threads (a running migration is cancelled) and destroys the MP
        groups KeelMoE made."""
        self.engine.close()
        if self.mp is not None:
            self.mp.destroy()


def _collective_timeout(config: Any) -> float:
    if config is None:
        from keel import Config
        config = Config()
    return float(config.to_dict()["engine"]["collective_timeout_seconds"])


def _current_cuda_device(device: torch.device) -> Any:
    """``device`` current for the block when it is a CUDA device (the engine takes the device
    current at its creation), else nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
