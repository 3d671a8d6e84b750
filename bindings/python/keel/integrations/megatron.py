"""keel.integrations.megatron: Keel as the token dispatcher and the experts of Megatron-Core's
``MoELayer``.

Megatron-Core's ``MoELayer.forward`` runs its router (``probs`` and ``routing_map``, both
``[T, E]``), then six calls of its token dispatcher around its experts::

    hidden, probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    hidden, probs = dispatcher.token_dispatch(hidden, probs)
    hidden, tokens_per_expert, probs = dispatcher.dispatch_postprocess(hidden, probs)
    out, bias = experts(hidden, tokens_per_expert, probs)
    out = dispatcher.combine_preprocess(out)
    out = dispatcher.token_combine(out)
    out = dispatcher.combine_postprocess(out)

:func:`use_keel` puts a :class:`KeelTokenDispatcher` in every MoE layer's ``token_dispatcher``
and a :class:`KeelExperts` (no parameters) in its ``experts``. The dispatcher turns the router's
``[T, E]`` output into Keel's ``[T, K]`` top-k ids and weights (:func:`routing_to_topk`) and,
in ``token_dispatch``, runs the whole of Keel's layer (:class:`keel.torch.MoEDispatcher`): each
choice goes to a physical copy of its expert (home, replica or transient replica) through one
all-to-all, each copy runs Megatron's own expert module on its rows (:func:`expert_module_spec`),
a second all-to-all brings the outputs back and they are summed weighted by ``probs``. The other
five calls only reshape or pass their input on. Megatron's router, its auxiliary losses, expert
bias and shared experts stay as they are.

Keel's slot parameters (every expert copy) live in the dispatcher, an object outside the module
tree, so ``model.parameters()`` does not hold them: megatron-core 0.16's
``DistributedDataParallel`` puts every parameter it sees in its gradient buckets (and, with the
distributed optimizer, moves its storage into them) and ``get_megatron_optimizer`` makes groups
of every parameter it sees, while Keel's engine holds the slots by address and moves homes
between them. Keel's own optimizer steps them (:meth:`keel.torch.KeelMoE.attach` folds every
replica's gradient into its home before that step and refreshes the replicas after it).

Supported: megatron-core ``>= 0.16.1, < 0.17.0`` (:data:`SUPPORTED_VERSIONS`); importing this
module with another version raises :class:`keel.UnimplementedError`. docs/integrations/megatron.md
shows the lines a training script changes and what has run where.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from keel._errors import InvalidArgumentError, UnimplementedError
from keel.integrations._modules import module_on_slots
from keel.integrations._versions import require
from keel.torch import KeelMoE, MoEDispatcher
from keel.torch.experts import ExpertSpec

#: The megatron-core releases this module supports: at least the first, below the second.
SUPPORTED_VERSIONS = ("0.16.1", "0.17.0")


def check_version(version: Optional[str] = None) -> str:
    """Returns ``version`` (default: the installed megatron-core's, from its package metadata)
    when this module supports it; raises :class:`keel.UnimplementedError` naming the version and
    the supported range otherwise (a pre-release of the upper bound is outside it)."""
    return require("keel.integrations.megatron", "megatron-core", SUPPORTED_VERSIONS,
                   "MoELayer's token dispatcher interface (dispatch_preprocess, token_dispatch, "
                   "dispatch_postprocess, combine_preprocess, token_combine, "
                   "combine_postprocess) and SequentialMLP experts", version)


MEGATRON_VERSION = check_version()

# Only after the version check: another release may not have these modules at all.
from megatron.core import utils as megatron_utils  # noqa: E402
from megatron.core.transformer.mlp import MLP  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher  # noqa: E402


# --- probs and routing_map <-> top-k ids and weights --------------------------------------------
def routing_to_topk(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor,
                    top_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's router output as Keel's top-k choices.

    Args:
        probs_TE: ``[T, E]`` float, the router's weight of each (token, expert); 0 off the map.
        routing_map_TE: ``[T, E]`` bool, the (token, expert) pairs the router chose.
        top_k: K, the router's ``moe_router_topk``.

    Returns ``(ids_TK, weights_TK)``: ``[T, K]`` int64 expert ids and ``[T, K]`` weights of
    ``probs_TE``'s dtype (a gather of ``probs_TE``: gradients flow back into it). A choice is an
    entry of the map whose weight is not 0; each token's choices are in ascending expert order
    (equal weights do not matter), the unused places ``-1`` with weight 0. So a token the router
    dropped over capacity, or masked as padding, has no choice (its output is 0, as in Megatron's
    dispatchers), and the zero-weight entries that ``moe_pad_expert_input_to_capacity`` adds to
    fill each expert's capacity reach no expert: they add 0 to the output and to every gradient.
    More than K choices in a row is an :class:`keel.InvalidArgumentError`.
    """
    if probs_TE.dim() != 2 or routing_map_TE.shape != probs_TE.shape:
        raise InvalidArgumentError(
            f"probs {list(probs_TE.shape)} and routing_map {list(routing_map_TE.shape)} must "
            f"both be [num_tokens, num_experts]")
    if routing_map_TE.dtype != torch.bool:
        raise InvalidArgumentError(f"routing_map is {routing_map_TE.dtype}, not torch.bool")
    tokens, experts = probs_TE.shape
    chosen_TE = routing_map_TE & (probs_TE != 0)
    # Chosen experts sort first, by id; the others get the key E and sort last.
    expert_ids = torch.arange(experts, device=probs_TE.device)
    keys_TE = torch.where(chosen_TE, expert_ids, experts)
    keys_TE = torch.sort(keys_TE, dim=1, stable=True).values
    if experts > top_k:
        extra = keys_TE[:, top_k] < experts
        if bool(extra.any()):
            row = int(torch.nonzero(extra)[0, 0])
            raise InvalidArgumentError(
                f"token {row} of {tokens} has {int(chosen_TE[row].sum())} experts with a "
                f"nonzero weight in the routing map; top_k = {top_k}")
    width = min(top_k, experts)
    keys_TK = keys_TE[:, :width]
    if width < top_k:
        keys_TK = torch.cat([keys_TK, keys_TK.new_full((tokens, top_k - width), experts)], 1)
    kept_TK = keys_TK < experts
    ids_TK = torch.where(kept_TK, keys_TK, -1)
    weights_TK = probs_TE.gather(1, torch.where(kept_TK, keys_TK, 0))
    weights_TK = torch.where(kept_TK, weights_TK, torch.zeros_like(weights_TK))
    return ids_TK, weights_TK


def topk_to_routing(ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                    num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`routing_to_topk`: ``[T, K]`` ids (``-1`` unused) and weights as
    Megatron's ``[T, E]`` ``probs`` (0 off the map) and bool ``routing_map``. An id twice in a
    row, or outside ``[-1, num_experts)``, is an :class:`keel.InvalidArgumentError`."""
    if ids_TK.shape != weights_TK.shape or ids_TK.dim() != 2:
        raise InvalidArgumentError(
            f"ids {list(ids_TK.shape)} and weights {list(weights_TK.shape)} must both be "
            f"[num_tokens, top_k]")
    if bool(((ids_TK < -1) | (ids_TK >= num_experts)).any()):
        raise InvalidArgumentError(f"an expert id is outside [-1, {num_experts})")
    tokens = ids_TK.shape[0]
    kept_TK = ids_TK >= 0
    slot_TK = torch.where(kept_TK, ids_TK, num_experts)  # column E collects the unused places
    counts_TE = torch.zeros(tokens, num_experts + 1, dtype=torch.int64, device=ids_TK.device)
    counts_TE.scatter_add_(1, slot_TK, torch.ones_like(slot_TK))
    if bool((counts_TE[:, :num_experts] > 1).any()):
        raise InvalidArgumentError("an expert appears twice among a token's choices")
    probs_TE = weights_TK.new_zeros(tokens, num_experts + 1)
    probs_TE = probs_TE.scatter(1, slot_TK, torch.where(kept_TK, weights_TK,
                                                        torch.zeros_like(weights_TK)))
    return probs_TE[:, :num_experts], counts_TE[:, :num_experts] > 0


# --- the expert ---------------------------------------------------------------------------------
def expert_module_spec(expert: torch.nn.Module, hidden_size: int) -> ExpertSpec:
    """One of Megatron's expert modules (an ``MLP`` of ``SequentialMLP.local_experts``) as a
    Keel expert.

    Parameters: the module's own, of their shapes and in their order, named as in
    ``named_parameters()`` with ``.`` made ``_`` (``linear_fc1.weight`` ->
    ``linear_fc1_weight``). ``forward(params, x_RH)`` (``x_RH`` ``[R, hidden_size]``) is the
    module's own forward on the slot's parameters (:func:`module_on_slots`: the copy it runs
    shares the module's config and process groups) with its bias added: ``MLP`` returns ``(output, output_bias)`` and, without the router's
    weights (``per_token_scale``), leaves fc2's bias to the caller. Keel multiplies each output
    row by its weight afterwards; Megatron multiplies the activation before fc2 and its bias by
    the weight, which is the same linear map. The initial values come from the model
    (:func:`use_keel`), not from ``init``.
    """
    shapes, call = module_on_slots(expert)

    def forward(slot: Dict[str, torch.Tensor], x_RH: torch.Tensor) -> torch.Tensor:
        out = call(slot, x_RH)
        if isinstance(out, tuple):
            out, bias = out[0], (out[1] if len(out) > 1 else None)
            if bias is not None:
                out = out + bias
        return out

    def init(generator: torch.Generator) -> Dict[str, torch.Tensor]:
        raise UnimplementedError(
            "a Megatron expert's initial values come from the model's SequentialMLP "
            "(keel.integrations.megatron.use_keel passes them as init_expert)")

    return ExpertSpec(shapes, forward, init, hidden_size, hidden_size)


# --- the dispatcher and the experts -------------------------------------------------------------
class KeelTokenDispatcher(MoETokenDispatcher):
    """Keel as ``MoELayer.token_dispatcher``, with Megatron's six dispatcher calls:

    - ``dispatch_preprocess(hidden_states, routing_map, probs)``: ``hidden_states``
      ``[S, B, H]`` (any shape ending in H; T tokens), ``routing_map`` ``[T, E]`` bool, ``probs``
      ``[T, E]`` float -> ``([T, H] tokens, [T, K] weights)``; the ``[T, K]`` ids
      (:func:`routing_to_topk`) are kept for the next call.
    - ``token_dispatch(hidden, weights)`` -> ``([T, H] output, weights)``: Keel's whole layer
      (route, all-to-all, every copy's expert, all-to-all back, the weighted sum in float32);
      collective over the KeelMoE's group, every rank calling every layer in the same order.
    - ``dispatch_postprocess(output, weights)`` -> ``(output, tokens_per_expert, weights)``:
      ``tokens_per_expert`` ``[E]`` int64 is this rank's choices per expert, on the device.
    - ``combine_preprocess``, ``token_combine``: the output as it is.
    - ``combine_postprocess(output)``: the output in ``hidden_states``' shape.

    ``self.dispatcher`` is the layer's :class:`keel.torch.MoEDispatcher`, which holds the slots
    (deliberately outside the model's module tree: see the module's doc).
    """

    def __init__(self, dispatcher: MoEDispatcher, config: Any, pg_collection: Any) -> None:
        if not isinstance(dispatcher, MoEDispatcher):
            raise InvalidArgumentError(
                f"dispatcher is {type(dispatcher).__name__}, not a keel.torch.MoEDispatcher")
        super().__init__(config=config, pg_collection=pg_collection)
        self.dispatcher = dispatcher
        self.num_experts = dispatcher._moe.num_experts
        self.top_k = dispatcher._moe.top_k
        self.hidden_shape: Optional[torch.Size] = None
        self._ids_TK: Optional[torch.Tensor] = None

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = tokens.shape
        ids_TK, weights_TK = routing_to_topk(probs, routing_map, self.top_k)
        self._ids_TK = ids_TK
        return tokens.reshape(-1, tokens.shape[-1]), weights_TK

    def token_dispatch(self, hidden_states: torch.Tensor,
                       probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._ids_TK is None:
            raise InvalidArgumentError("token_dispatch before dispatch_preprocess")
        ids_TK = self._ids_TK
        return self.dispatcher(hidden_states, ids_TK, probs), probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids_TK, self._ids_TK = self._ids_TK, None
        assert ids_TK is not None
        # Counted on the device (a scatter, no copy to the host); unused places go to column E.
        column = torch.where(ids_TK >= 0, ids_TK, self.num_experts).reshape(-1)
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=ids_TK.device)
        counts.scatter_add_(0, column, torch.ones_like(column))
        return hidden_states, counts[:self.num_experts], probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.hidden_shape is not None
        return hidden_states.view(self.hidden_shape)


class KeelExperts(torch.nn.Module):
    """``MoELayer.experts`` with Keel: the experts ran inside :class:`KeelTokenDispatcher`'s
    ``token_dispatch``, so ``forward(hidden, tokens_per_expert, probs)`` returns
    ``(hidden, None)`` (no bias: MoELayer asserts that) and the module holds no parameters."""

    def forward(self, hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return hidden_states, None

    def backward_dw(self) -> None:
        """MoELayer.backward_dw's call (delayed weight gradients): Keel's are not delayed."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: Any = (),
                           metadata: Any = None) -> Dict[str, Any]:
        """Nothing: Keel's experts are saved by logical expert (KeelMoE.state_dict)."""
        return {}


# --- putting Keel into a model ------------------------------------------------------------------
def moe_layers(model: torch.nn.Module) -> List[Tuple[str, MoELayer]]:
    """Every Megatron ``MoELayer`` of ``model`` as (name, module), in module order: Keel's layer
    index ``l`` is the ``l``-th of them."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, MoELayer)]


def _ranks(group: Any) -> List[int]:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _check_layer(name: str, layer: MoELayer) -> None:
    """Refuses, by name, a layer whose parallelism or experts this module was not written for."""
    if isinstance(layer.token_dispatcher, KeelTokenDispatcher) or isinstance(layer.experts,
                                                                             KeelExperts):
        raise InvalidArgumentError(f"{name} already has Keel's dispatcher and experts")
    experts = layer.experts
    if not isinstance(experts, SequentialMLP) or not all(
            isinstance(e, MLP) for e in experts.local_experts):
        raise UnimplementedError(
            f"{name}.experts is {type(experts).__name__}; Keel takes SequentialMLP experts of "
            f"MLP modules (moe_grouped_gemm=False with the local layer spec): the grouped "
            f"experts keep all local experts in one tensor, which Keel's slots do not share "
            f"(docs/integrations/megatron.md)")
    if any(p.is_meta for p in experts.parameters()):
        raise InvalidArgumentError(
            f"{name}.experts has parameters on the meta device: call use_keel after the model's "
            f"weights are initialized or loaded; the experts start from them")
    config = layer.config
    for what, group in (("tensor-parallel", layer.attn_tp_group),
                        ("expert tensor-parallel", experts.tp_group),
                        ("expert data-parallel", experts.dp_group)):
        size = megatron_utils.get_pg_size(group)
        if size > 1:
            raise UnimplementedError(
                f"{name}: the {what} group has {size} ranks; Keel's Megatron dispatcher has "
                f"been written for expert parallelism over the whole data-parallel group "
                f"(tensor, expert tensor and expert data parallelism of size 1)")
    if config.moe_shared_expert_overlap:
        raise UnimplementedError(
            f"{name}: moe_shared_expert_overlap runs the shared experts inside Megatron's "
            f"dispatcher; Keel's does not: turn it off (the shared experts then run in "
            f"MoELayer, unchanged)")
    if config.fp8 or config.fp4:
        raise UnimplementedError(f"{name}: fp8/fp4 experts are not supported by Keel's "
                                 f"Megatron dispatcher")


def _all_experts(name: str, layer: MoELayer, spec: ExpertSpec) -> List[Dict[str, torch.Tensor]]:
    """Every expert of ``layer`` (Keel's parameter name -> tensor) in Megatron's numbering:
    expert-parallel rank r holds experts ``r * L .. r * L + L - 1`` as ``local_experts``
    ``0 .. L - 1``. Collective over the layer's expert-parallel group."""
    local = [[p.detach().contiguous() for p in expert.parameters()]
             for expert in layer.experts.local_experts]
    ep_size = megatron_utils.get_pg_size(layer.ep_group)
    if ep_size > 1:
        by_rank = [[[torch.empty_like(p) for p in params] for params in local]
                   for _ in range(ep_size)]
        for i, params in enumerate(local):
            for j, p in enumerate(params):
                dist.all_gather([theirs[i][j] for theirs in by_rank], p, group=layer.ep_group)
        local = [params for theirs in by_rank for params in theirs]
    if len(local) != layer.config.num_moe_experts:
        raise InvalidArgumentError(
            f"{name}: gathered {len(local)} experts, the config has "
            f"{layer.config.num_moe_experts}")
    return [dict(zip(spec.names, params)) for params in local]


def use_keel(model: torch.nn.Module, *, config: Any = None, group: Any = None,
             **keel_moe_args: Any) -> KeelMoE:
    """Puts Keel into every Megatron ``MoELayer`` of ``model`` (a :class:`KeelTokenDispatcher`
    as ``token_dispatcher``, :class:`KeelExperts` as ``experts``) over one
    :class:`keel.torch.KeelMoE`, and returns the KeelMoE.

    Collective over the layers' expert-parallel group (every rank calls it with the same model),
    after the model's weights are initialized or loaded (each expert starts from the model's
    values, which the group gathers) and before Megatron's ``DistributedDataParallel`` and
    optimizer are built, so that neither holds the replaced ``SequentialMLP``. Keel's slots are
    outside the module tree: step them with an optimizer of their own, then ``moe.attach``::

        moe = use_keel(model, config=keel_config)
        model = DistributedDataParallel(config, ddp_config, model)   # Keel's slots not in it
        expert_optimizer = torch.optim.AdamW(moe.parameters(), lr=...)
        moe.attach(expert_optimizer)

    Args:
        model: a model (or any module) holding Megatron ``MoELayer`` s with ``SequentialMLP``
            experts of ``MLP`` modules; every layer needs the same number of experts, top-k and
            expert (parameter names, shapes, dtypes), tensor, expert tensor and expert data
            parallelism of size 1 (expert parallelism over the data-parallel group).
        config: :class:`keel.torch.KeelMoE`'s; ``config.topology`` must cover the group's ranks.
        group: the ``torch.distributed`` group Keel places the experts over; default and
            requirement: the layers' expert-parallel group (its ranks).
        keel_moe_args: the other arguments of KeelMoE (``optimizer``, ``average_gradients``,
            ...). ``device`` and ``dtype`` default to the experts' own; ``average_gradients``
            to what Megatron's DDP does to expert gradients: divide by the data-parallel size,
            unless ``calculate_per_token_loss``.
    """
    layers = moe_layers(model)
    if not layers:
        raise InvalidArgumentError(
            f"model ({type(model).__name__}) holds no Megatron MoELayer "
            f"(megatron.core.transformer.moe.moe_layer)")
    shape = None
    for name, layer in layers:
        _check_layer(name, layer)
        expert = layer.experts.local_experts[0]
        mine = (tuple((n, tuple(p.shape), p.dtype) for n, p in expert.named_parameters()),
                layer.config.num_moe_experts, layer.config.moe_router_topk)
        if shape is not None and mine != shape:
            raise InvalidArgumentError(
                f"{name}: {mine[1]} experts {[(n, list(s)) for n, s, _ in mine[0]]}, "
                f"top-{mine[2]}; the first MoE layer has {shape[1]} experts "
                f"{[(n, list(s)) for n, s, _ in shape[0]]}, top-{shape[2]}: one KeelMoE needs "
                f"the same experts in every layer")
        shape = mine
        if group is not None and _ranks(layer.ep_group) != _ranks(group):
            raise InvalidArgumentError(
                f"{name}: the expert-parallel group holds ranks {_ranks(layer.ep_group)}, "
                f"Keel's group {_ranks(group)}: Keel places the experts over the layer's "
                f"expert-parallel group")
        if _ranks(layer.ep_group) != _ranks(layers[0][1].ep_group):
            raise InvalidArgumentError(f"{name}: another expert-parallel group than the first "
                                       f"MoE layer's")
    assert shape is not None
    first = layers[0][1]
    fc1 = first.experts.local_experts[0].linear_fc1.weight
    spec = expert_module_spec(first.experts.local_experts[0], hidden_size=fc1.shape[1])
    stacked = [_all_experts(name, layer, spec) for name, layer in layers]
    keel_moe_args.setdefault("device", fc1.device)
    keel_moe_args.setdefault("dtype", fc1.dtype)
    keel_moe_args.setdefault("average_gradients", not first.config.calculate_per_token_loss)

    def init_expert(layer: int, expert: int) -> Dict[str, torch.Tensor]:
        return stacked[layer][expert]

    moe = KeelMoE(spec, num_layers=len(layers), num_experts=shape[1], top_k=shape[2],
                  group=group if group is not None else first.ep_group, config=config,
                  init_expert=init_expert, **keel_moe_args)
    stacked.clear()  # the slots hold the values now; let the gathered experts go
    for index, (_, layer) in enumerate(layers):
        old = layer.token_dispatcher
        groups = _Groups(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        layer.token_dispatcher = KeelTokenDispatcher(moe.layer(index), layer.config, groups)
        layer.experts = KeelExperts()
    return moe


class _Groups:
    """The process groups MoETokenDispatcher's constructor reads from a ProcessGroupCollection."""

    def __init__(self, ep: Any, expt_tp: Any, tp_ep: Any) -> None:
        self.ep, self.expt_tp, self.tp_ep = ep, expt_tp, tp_ep


__all__ = ["KeelExperts", "KeelTokenDispatcher", "MEGATRON_VERSION", "SUPPORTED_VERSIONS",
           "check_version", "expert_module_spec", "moe_layers", "routing_to_topk",
           "topk_to_routing", "use_keel"]
