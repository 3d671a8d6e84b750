"""keel.integrations.deepspeed: Keel as the experts and both all-to-alls of DeepSpeed's MoE layers.

DeepSpeed's ``MoE`` (``deepspeed/moe/layer.py``) holds a ``MOELayer`` (``MoE.deepspeed_moe``) that
runs its ``TopKGate``, packs each expert's tokens into an ``[E, capacity, M]`` buffer, sends it
through an all-to-all over the expert-parallel group, runs the local ``Experts``, sends the
outputs back through a second all-to-all and sums them weighted by the gate. :func:`use_keel`
puts a :class:`KeelMOELayer` in place of ``deepspeed_moe`` in every MoE layer of a model: the
same ``TopKGate`` (top-k, capacity, dropped tokens, auxiliary loss, expert counts), then one
:class:`keel.torch.MoEDispatcher` per layer, which sends each choice the gate kept to a physical
copy of its expert (home, replica or transient replica) and sums the outputs weighted by the
gate, in float32, as MOELayer does. A choice the gate dropped (over capacity with
``drop_tokens``, or a token ``used_token`` masks) stays dropped: it reaches no expert and adds
nothing. Only the kept rows travel; there is no capacity padding. Each slot runs the model's own
expert module (:func:`expert_module_spec`), so the expert arithmetic is DeepSpeed's.

Supported: deepspeed ``>= 0.19.8, < 0.20.0`` (:data:`SUPPORTED_VERSIONS`); importing this module
with another version raises :class:`keel.UnimplementedError`. docs/integrations/deepspeed.md
shows the lines a training script changes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from keel._errors import FailedPreconditionError, InvalidArgumentError, UnimplementedError
from keel.integrations._modules import module_on_slots
from keel.integrations._versions import require
from keel.torch import KeelMoE, MoEDispatcher
from keel.torch.experts import ExpertSpec

#: The deepspeed releases this module supports: at least the first, below the second.
SUPPORTED_VERSIONS = ("0.19.8", "0.20.0")


def check_version(version: Optional[str] = None) -> str:
    """Returns ``version`` (default: the installed deepspeed's, from its package metadata) when
    this module supports it; raises :class:`keel.UnimplementedError` naming the version and the
    supported range otherwise (a pre-release of the upper bound is outside it)."""
    return require("keel.integrations.deepspeed", "deepspeed", SUPPORTED_VERSIONS,
                   "MoE layer's interface (MoE.deepspeed_moe: MOELayer with its TopKGate, whose "
                   "routes it reads, and Experts)", version)


DEEPSPEED_VERSION = check_version()

# Only after the version check: another release may not have these modules at all.
import deepspeed.comm  # noqa: E402
from deepspeed.moe.experts import Experts  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.sharded_moe import MOELayer, TopKGate  # noqa: E402
from deepspeed.utils import groups  # noqa: E402
from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size  # noqa: E402


def expert_module_spec(expert: torch.nn.Module, hidden_size: int) -> ExpertSpec:
    """One DeepSpeed expert (the module given to ``MoE``, of which ``Experts`` holds copies) as a
    Keel expert.

    Parameters: the module's own, of their shapes and in their order, each named as in
    ``named_parameters()`` with ``.`` made ``_`` (``0.weight`` -> ``0_weight``: a slot's
    parameter names have no dots). ``forward(params, x_RM)`` (``x_RM`` ``[R, hidden_size]``)
    is the module's own forward on the slot's parameters (``torch.func.functional_call`` on a
    copy of the module whose parameters are on the meta device: :func:`module_on_slots`),
    and a tuple result gives its first element, as ``Experts`` takes it. The module must treat
    each row on its own, as MOELayer's capacity buffers already require. The initial values
    come from the model (:func:`use_keel`), not from ``init``.
    """
    shapes, call = module_on_slots(expert)

    def forward(slot: Dict[str, torch.Tensor], x_RM: torch.Tensor) -> torch.Tensor:
        out = call(slot, x_RM)
        return out[0] if isinstance(out, tuple) else out

    def init(generator: torch.Generator) -> Dict[str, torch.Tensor]:
        raise UnimplementedError(
            "a DeepSpeed expert's initial values come from the model's Experts "
            "(keel.integrations.deepspeed.use_keel passes them as init_expert)")

    return ExpertSpec(shapes, forward, init, hidden_size, hidden_size)


def _check_no_tensor_parallelism(name: str) -> None:
    if bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
        raise UnimplementedError(
            f"{name}: DeepSpeed runs tensor parallelism (its mpu has "
            f"{bwc_tensor_model_parallel_world_size(groups.mpu)} ranks per group); Keel's "
            f"DeepSpeed layer has not been written for it (docs/integrations/deepspeed.md)")


class KeelMOELayer(torch.nn.Module):
    """Keel in place of DeepSpeed's ``MOELayer`` (``MoE.deepspeed_moe``), with its forward's
    signature and the attributes that ``MoE.forward`` reads:

    - ``hidden_states``: ``[..., M]`` float32, bfloat16 or float16 (``MoE`` passes
      ``[B, S, M]``), this rank's tokens; T below is their number.
    - ``used_token``: ``[T]`` or None, passed to the gate (its top-1 gating routes only the
      tokens it marks).
    - result: ``hidden_states``' shape and dtype, ``sum_k gate[t, k] * expert[id[t, k]](x[t])``
      over the choices the gate kept (a dropped choice adds nothing), the sum in float32.
    - ``l_aux`` (float32 scalar) and ``exp_counts`` (``[E]`` int64, this rank's choices per
      expert before capacity): the gate's, set by each forward.

    ``self.gate`` is DeepSpeed's ``TopKGate``, unchanged but for its expert-parallel group,
    which it no longer gets (:meth:`_set_ep_group`); ``self.dispatcher`` is Keel's, and the
    layer is collective like it: every rank calls every layer in the same order.
    """

    def __init__(self, gate: torch.nn.Module, dispatcher: MoEDispatcher) -> None:
        super().__init__()
        if not isinstance(gate, TopKGate):
            raise InvalidArgumentError(
                f"gate is {type(gate).__name__}, not DeepSpeed's TopKGate "
                f"(deepspeed.moe.sharded_moe)")
        if not isinstance(dispatcher, MoEDispatcher):
            raise InvalidArgumentError(
                f"dispatcher is {type(dispatcher).__name__}, not a keel.torch.MoEDispatcher")
        # The gate's group serves one purpose: without drop_tokens, the all-reduce of the
        # largest expert count that sizes MOELayer's buffers. Keel has no such buffers, and the
        # gate keeps every choice with its own count as well.
        gate.ep_group = None
        self.gate = gate
        self.dispatcher = dispatcher
        self.ep_group: Any = None
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def _set_ep_group(self, ep_group: Any) -> None:
        """``MoE.set_deepspeed_parallelism`` (which DeepSpeed's engine calls) hands the layer
        its expert-parallel group here. Kept, not used: Keel dispatches over its KeelMoE's
        group, and the gate needs none."""
        _check_no_tensor_parallelism("a KeelMOELayer")
        self.ep_group = ep_group

    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        x_TM = hidden_states.reshape(-1, hidden_states.shape[-1])
        # The gate's routes, as MOELayer asks for them (sparse_routes): [K, T] int32 expert per
        # choice (-1 where dropped) and [K, T] float32 weight per choice (0 where dropped,
        # normalised over the kept ones); the capacity and buffer locations are MOELayer's only.
        self.l_aux, _, _, experts_KT, _, weights_KT, self.exp_counts = self.gate(
            x_TM, used_token, True)
        out_TM = self.dispatcher(x_TM, experts_KT.t(), weights_KT.t())
        return out_TM.view(hidden_states.shape)


def moe_layers(model: torch.nn.Module) -> List[Tuple[str, MoE]]:
    """Every DeepSpeed ``MoE`` of ``model`` as (name, module), in module order: Keel's layer
    index ``l`` is the ``l``-th of them."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def _all_experts(name: str, layer: MoE, spec: ExpertSpec) -> List[Dict[str, torch.Tensor]]:
    """Every expert of ``layer`` (Keel's parameter name -> tensor), in DeepSpeed's numbering:
    expert-parallel rank r holds experts ``r * L .. r * L + L - 1`` as its local experts
    ``0 .. L - 1`` (MOELayer's all-to-all sends block r of the ``[E, C, M]`` buffer to rank r).
    Collective over the layer's expert-parallel group, which this makes where DeepSpeed has not
    yet (``MoE.set_deepspeed_parallelism``)."""
    local = [[p.detach() for p in expert.parameters()]
             for expert in layer.deepspeed_moe.experts.deepspeed_experts]
    if layer.ep_size > 1:
        if layer.deepspeed_moe.ep_group is None:
            if not deepspeed.comm.is_initialized():
                raise FailedPreconditionError(
                    f"{name}: DeepSpeed's MoE with ep_size = {layer.ep_size} holds "
                    f"{layer.num_local_experts} of the {layer.num_experts} experts on each rank; "
                    f"gathering them needs its expert-parallel group: call "
                    f"deepspeed.init_distributed() before use_keel")
            layer.set_deepspeed_parallelism()
        group = layer.deepspeed_moe.ep_group
        by_rank = [[[torch.empty_like(p) for p in params] for params in local]
                   for _ in range(layer.ep_size)]
        for i, params in enumerate(local):
            for j, p in enumerate(params):
                dist.all_gather([theirs[i][j] for theirs in by_rank], p.contiguous(), group=group)
        local = [params for theirs in by_rank for params in theirs]
    return [dict(zip(spec.names, params)) for params in local]


def use_keel(model: torch.nn.Module, *, config: Any = None, group: Any = None,
             **keel_moe_args: Any) -> KeelMoE:
    """Replaces ``deepspeed_moe`` of every DeepSpeed MoE layer of ``model`` with a
    :class:`KeelMOELayer` (the layer's own ``TopKGate``, Keel's dispatcher) over one
    :class:`keel.torch.KeelMoE`, and returns the KeelMoE.

    Collective over ``group`` (default: the world): every rank calls it with the same model,
    after the model's weights are initialized or loaded (each expert starts from the model's
    values; the ranks' expert-parallel groups gather them) and before the optimizer is built over
    ``model.parameters()`` and ``deepspeed.initialize``; then ``moe.attach(optimizer)``. Each
    layer's ``ep_size`` must be the group's size: Keel places the experts over all its ranks, and
    DeepSpeed's engine, whose expert-data-parallel groups are then single ranks, leaves Keel's
    slots alone (they are marked as DeepSpeed marks expert parameters: ``allreduce = False``,
    ``group_name``), only dividing their gradients by the data-parallel size as it does its own
    experts'. So ``average_gradients`` defaults to False: Keel sums the copies into each home.

    Args:
        model: a model (or any module) holding DeepSpeed ``MoE`` layers whose ``deepspeed_moe``
            is DeepSpeed's ``MOELayer``; every layer needs the same number of experts, top-k
            and expert module (class, parameter names, shapes and dtypes).
        config, group: :class:`keel.torch.KeelMoE`'s; ``config.topology`` must cover the
            group's ranks.
        keel_moe_args: the other arguments of KeelMoE (``optimizer``, ``average_gradients``,
            ...). ``device`` and ``dtype`` default to the experts' own.
    """
    layers = moe_layers(model)
    if not layers:
        raise InvalidArgumentError(
            f"model ({type(model).__name__}) holds no DeepSpeed MoE layer "
            f"(deepspeed.moe.layer.MoE)")
    ranks = dist.get_world_size(group)
    shape = None
    for name, layer in layers:
        moe_layer = layer.deepspeed_moe
        if not (isinstance(moe_layer, MOELayer) and isinstance(moe_layer.gate, TopKGate)
                and isinstance(moe_layer.experts, Experts)):
            raise InvalidArgumentError(
                f"{name}.deepspeed_moe is {type(moe_layer).__name__}, not DeepSpeed's MOELayer "
                f"with its TopKGate and Experts (already Keel's?)")
        if layer.ep_size != ranks:
            raise InvalidArgumentError(
                f"{name}: ep_size = {layer.ep_size}, but Keel's group has {ranks} ranks: build "
                f"DeepSpeed's MoE with ep_size = {ranks}; Keel places the experts over every "
                f"rank of the group")
        _check_no_tensor_parallelism(name)
        if any(p.is_meta for p in moe_layer.experts.parameters()):
            raise InvalidArgumentError(
                f"{name}.deepspeed_moe.experts has parameters on the meta device: call use_keel "
                f"after the model's weights are initialized or loaded; the experts start from them")
        expert = moe_layer.experts.deepspeed_experts[0]
        mine = (type(expert), tuple((n, tuple(p.shape), p.dtype)
                                    for n, p in expert.named_parameters()),
                layer.num_experts, moe_layer.gate.k)
        if shape is not None and mine != shape:
            raise InvalidArgumentError(
                f"{name}: {layer.num_experts} experts {mine[0].__name__} "
                f"{[(n, list(s)) for n, s, _ in mine[1]]}, top-{mine[3]}; the first MoE layer "
                f"has {shape[2]} experts {shape[0].__name__} "
                f"{[(n, list(s)) for n, s, _ in shape[1]]}, top-{shape[3]}: one KeelMoE needs "
                f"the same experts in every layer")
        shape = mine
    assert shape is not None
    first = layers[0][1].deepspeed_moe
    spec = expert_module_spec(first.experts.deepspeed_experts[0],
                              hidden_size=first.gate.wg.weight.shape[1])
    stacked = [_all_experts(name, layer, spec) for name, layer in layers]
    some = next(first.experts.deepspeed_experts[0].parameters())
    keel_moe_args.setdefault("device", some.device)
    keel_moe_args.setdefault("dtype", some.dtype)
    keel_moe_args.setdefault("average_gradients", False)

    def init_expert(layer: int, expert: int) -> Dict[str, torch.Tensor]:
        return stacked[layer][expert]

    moe = KeelMoE(spec, num_layers=len(layers), num_experts=shape[2], top_k=shape[3],
                  group=group, config=config, init_expert=init_expert, **keel_moe_args)
    stacked.clear()  # the slots hold the values now; let the gathered experts go
    for index, (_, layer) in enumerate(layers):
        dispatcher = moe.layer(index)
        for param in dispatcher.parameters():
            param.allreduce = False
            param.group_name = layer.expert_group_name
        layer.deepspeed_moe = KeelMOELayer(layer.deepspeed_moe.gate, dispatcher)
    return moe


__all__ = ["DEEPSPEED_VERSION", "KeelMOELayer", "SUPPORTED_VERSIONS", "check_version",
           "expert_module_spec", "moe_layers", "use_keel"]
