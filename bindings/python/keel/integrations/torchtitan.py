"""keel.integrations.torchtitan: Keel as the routed experts of torchtitan's MoE layers.

torchtitan's ``MoE`` (``torchtitan/models/common/moe.py``) runs its router, then
``routed_experts(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)``
(token dispatch, ``GroupedExperts``, combine), then its shared experts, and counts the tokens per
expert that its expert-bias balancing reads. :func:`use_keel` puts a :class:`KeelRoutedExperts`
in place of ``routed_experts`` in every MoE layer of a model: the router's output goes to one
:class:`keel.torch.MoEDispatcher` per layer, which routes each token to a physical copy of its
expert (homes, replicas, transient replicas) and combines the outputs weighted by the router's
scores, after the experts, as torchtitan does. Everything else of the layer stays torchtitan's:
router, shared experts, ``tokens_per_expert_E``, ``expert_bias_E`` and the optimizer hook that
updates the bias. Each slot computes with torchtitan's own ``GroupedExperts`` (one expert per
call, :func:`grouped_experts_spec`), so the arithmetic is torchtitan's: SwiGLU in bfloat16
grouped GEMMs.

Supported: torchtitan ``>= 0.3.0, < 0.4.0`` (:data:`SUPPORTED_VERSIONS`); importing this module
with another version raises :class:`keel.UnimplementedError`. docs/integrations/torchtitan.md
shows the lines a training script changes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from keel._errors import InvalidArgumentError, UnimplementedError
from keel.integrations._versions import require
from keel.torch import KeelMoE, MoEDispatcher
from keel.torch.experts import ExpertSpec

#: The torchtitan releases this module supports: at least the first, below the second.
SUPPORTED_VERSIONS = ("0.3.0", "0.4.0")


def check_version(version: Optional[str] = None) -> str:
    """Returns ``version`` (default: the installed torchtitan's, from its package metadata) when
    this module supports it; raises :class:`keel.UnimplementedError` naming the version and the
    supported range otherwise (a pre-release of the upper bound is outside it)."""
    return require("keel.integrations.torchtitan", "torchtitan", SUPPORTED_VERSIONS,
                   "MoE layer's interface (MoE.routed_experts, GroupedExperts.w1_EFD/w2_EDF/"
                   "w3_EFD)", version)


TORCHTITAN_VERSION = check_version()

# Only after the version check: another release may not have these modules at all.
from torchtitan.models.common.moe import GroupedExperts, MoE  # noqa: E402


def fill_torch_gaps() -> List[str]:
    """Adds stand-ins for the two torch APIs that torchtitan 0.3.0 uses and torch 2.11 lacks,
    when they are missing; returns the names it added (none on a torch that has both).

    - ``torch.compiler._is_non_strict_tracing()``, asked by torchtitan's all-to-all token
      dispatcher (its own expert parallelism) on every forward: the stand-in answers False,
      which is right in eager execution (no non-strict ``make_fx`` tracing).
    - ``torch.distributed.fsdp.DataParallelMeshDims``, imported by torchtitan's model zoo
      (deepseek_v3, qwen3, llama3, ...) and its trainer: the stand-in lets them import;
      constructing it (the ``full_dtensor`` and ``spmd_types`` backends' FSDP do) raises
      :class:`keel.UnimplementedError`.

    Keel itself needs neither; call this before importing torchtitan's models on torch 2.11.
    """
    added = []
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False
        added.append("torch.compiler._is_non_strict_tracing")
    import torch.distributed.fsdp as fsdp
    if not hasattr(fsdp, "DataParallelMeshDims"):

        class DataParallelMeshDims:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise UnimplementedError(
                    f"torch {torch.__version__} has no torch.distributed.fsdp."
                    f"DataParallelMeshDims: torchtitan's full_dtensor and spmd_types "
                    f"backends need a newer torch; use parallelism.spmd_backend = "
                    f"'partial_dtensor'")

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    return added


# torchtitan's expert parameter -> Keel's per-expert parameter (the expert dimension dropped).
_PARAMETERS = {"w1_EFD": "w1_FD", "w2_EDF": "w2_DF", "w3_EFD": "w3_FD"}


def grouped_experts_spec(grouped_experts: torch.nn.Module) -> ExpertSpec:
    """One expert of torchtitan's ``GroupedExperts`` (or a subclass) as a Keel expert.

    Parameters: ``w1_FD`` ``[F, D]``, ``w2_DF`` ``[D, F]``, ``w3_FD`` ``[F, D]``, torchtitan's
    ``w1_EFD``, ``w2_EDF``, ``w3_EFD`` of one expert (D the model's dimension, F the experts'
    hidden dimension). ``forward(params, x_RD)`` is the module's own forward on one expert: a
    template of ``grouped_experts``'s class with one expert, built on the meta device, called
    with the slot's parameters (``torch.func.functional_call``), so a subclass's ``_grouped_mm``
    (a low-precision converter's) is used too. The initial values come from the model
    (:func:`use_keel`), not from ``init``.
    """
    if not isinstance(grouped_experts, GroupedExperts):
        raise InvalidArgumentError(
            f"grouped_experts is {type(grouped_experts).__name__}, not torchtitan's "
            f"GroupedExperts (torchtitan.models.common.moe)")
    _, hidden, dim = (int(d) for d in grouped_experts.w1_EFD.shape)
    kind = type(grouped_experts)
    try:
        with torch.device("meta"):
            template = kind.Config(dim=dim, hidden_dim=hidden, num_experts=1).build()
    except (TypeError, ValueError) as error:
        raise UnimplementedError(
            f"{kind.__name__}.Config(dim, hidden_dim, num_experts) cannot build a one-expert "
            f"template of this GroupedExperts subclass: {error}") from None

    def forward(params: Dict[str, torch.Tensor], x_RD: torch.Tensor) -> torch.Tensor:
        weights = {name: params[ours].unsqueeze(0) for name, ours in _PARAMETERS.items()}
        rows_E = torch.tensor([x_RD.shape[0]], dtype=torch.int64, device=x_RD.device)
        return torch.func.functional_call(template, weights, (x_RD, rows_E))

    def init(generator: torch.Generator) -> Dict[str, torch.Tensor]:
        raise UnimplementedError(
            "a torchtitan expert's initial values come from the model's GroupedExperts "
            "(keel.integrations.torchtitan.use_keel passes them as init_expert)")

    shapes = {"w1_FD": (hidden, dim), "w2_DF": (dim, hidden), "w3_FD": (hidden, dim)}
    return ExpertSpec(shapes, forward, init, dim, dim)


class KeelRoutedExperts(torch.nn.Module):
    """Keel in place of torchtitan's ``MoE.routed_experts`` (``RoutedExperts``), with its
    forward's signature:

    - ``x_BLD``: ``[B, L, D]`` float32 or bfloat16, this rank's tokens.
    - ``topk_scores_BLK``: ``[B, L, K]`` float32, the router's gate weight per choice
      (gradients flow back into it, to the router).
    - ``topk_expert_ids_BLK``: ``[B, L, K]`` int64, the router's expert per choice.
    - ``num_local_tokens_per_expert_E``: ``[E]``, this rank's tokens per expert; unused: the
      dispatcher counts the ids itself, on their device, in the one copy to the host it makes.
    - result ``[B, L, D]`` of ``x_BLD``'s dtype: ``sum_k topk_scores[b, l, k] *
      expert[topk_expert_ids[b, l, k]](x[b, l])``, the scores applied after the experts.

    Collective, like the dispatcher it holds (``self.dispatcher``).

    Checkpoints are in torchtitan's layout: ``state_dict()`` gives ``inner_experts.w1_EFD``
    ``[E, F, D]``, ``inner_experts.w2_EDF`` ``[E, D, F]`` and ``inner_experts.w3_EFD``, every
    expert's weights from its home, the same whole tensors on every rank (collective over the
    KeelMoE's group: every rank calls it, as ``torch.distributed.checkpoint.save`` does; DCP
    writes each once). ``load_state_dict`` takes those keys, as whole tensors (DTensors are
    gathered), and fills every copy this rank holds, under the placement in force. So a model
    with Keel and the same model without it (or with torchtitan's expert parallelism) load each
    other's checkpoints.
    """

    def __init__(self, dispatcher: MoEDispatcher) -> None:
        super().__init__()
        if not isinstance(dispatcher, MoEDispatcher):
            raise InvalidArgumentError(
                f"dispatcher is {type(dispatcher).__name__}, not a keel.torch.MoEDispatcher")
        self.dispatcher = dispatcher
        post_hook = getattr(self, "register_state_dict_post_hook", None)
        (post_hook or self._register_state_dict_hook)(_TorchtitanLayout.save)
        self.register_load_state_dict_pre_hook(_TorchtitanLayout.load)

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor,
                topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: Optional[torch.Tensor] = None) -> torch.Tensor:
        del num_local_tokens_per_expert_E
        B, L, D = x_BLD.shape
        K = topk_expert_ids_BLK.shape[-1]
        out_TD = self.dispatcher(x_BLD.reshape(B * L, D), topk_expert_ids_BLK.reshape(B * L, K),
                                 topk_scores_BLK.reshape(B * L, K))
        return out_TD.view(B, L, D)


class _TorchtitanLayout:
    """KeelRoutedExperts' state dict hooks: Keel's experts by logical id
    (``dispatcher.experts.{e}.w1_FD``, which the dispatcher's own hooks give and take) to and
    from torchtitan's stacked ``inner_experts.w1_EFD``."""

    @staticmethod
    def save(module: "KeelRoutedExperts", state: Dict[str, Any], prefix: str,
             local_metadata: Any) -> None:
        for key in [k for k in state if k.startswith(prefix + "dispatcher.")]:
            del state[key]
        dispatcher = module.dispatcher
        experts = dispatcher._moe.gather_experts(dispatcher.layer)
        for theirs, ours in _PARAMETERS.items():
            state[prefix + "inner_experts." + theirs] = torch.stack(
                [expert[ours] for expert in experts])

    @staticmethod
    def load(module: "KeelRoutedExperts", state: Dict[str, Any], prefix: str,
             local_metadata: Any, strict: bool, missing_keys: List[str],
             unexpected_keys: List[str], error_msgs: List[str]) -> None:
        from torch.distributed.tensor import DTensor
        dispatcher = module.dispatcher
        spec, num_experts = dispatcher._moe.spec, dispatcher._moe.num_experts
        found, wrong = {}, []
        for theirs, ours in _PARAMETERS.items():
            key = prefix + "inner_experts." + theirs
            value = state.pop(key, None)
            if value is None:
                continue  # the dispatcher reports its experts' entries missing
            if isinstance(value, DTensor):
                value = value.full_tensor()
            want = (num_experts, *spec.shapes[ours])
            if tuple(value.shape) != want:
                wrong.append(f"{key}: shape {list(value.shape)} in the checkpoint, "
                             f"{list(want)} in the model")
            found[ours] = value
        if wrong:  # no entry at all: the dispatcher leaves every slot as it is
            error_msgs.extend(wrong)
            return
        for ours, value in found.items():
            for expert in range(num_experts):
                state[f"{prefix}dispatcher.experts.{expert}.{ours}"] = value[expert]


def moe_layers(model: torch.nn.Module) -> List[Tuple[str, MoE]]:
    """Every torchtitan ``MoE`` of ``model`` as (name, module), in module order: Keel's layer
    index ``l`` is the ``l``-th of them."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def _full_experts(name: str, grouped_experts: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Keel's parameter -> the layer's ``[E, ...]`` expert weights, whole: a DTensor (sharded by
    FSDP) is gathered (collective over its mesh)."""
    from torch.distributed.tensor import DTensor
    out = {}
    for theirs, ours in _PARAMETERS.items():
        value = getattr(grouped_experts, theirs).detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if value.is_meta:
            raise InvalidArgumentError(
                f"{name}.routed_experts.inner_experts.{theirs} is on the meta device: call "
                f"use_keel after the model's weights are initialized (model.to_empty, "
                f"init_weights) or loaded; the experts start from them")
        out[ours] = value
    return out


def use_keel(model: torch.nn.Module, *, config: Any = None, group: Any = None,
             **keel_moe_args: Any) -> KeelMoE:
    """Replaces ``routed_experts`` of every torchtitan MoE layer of ``model`` with a
    :class:`KeelRoutedExperts` over one :class:`keel.torch.KeelMoE`, and returns the KeelMoE.

    Collective over ``group`` (default: the world): every rank calls it with the same model.
    Call it after the model's weights are initialized or loaded (each expert starts from the
    model's values, which must be the same on every rank, as torchtitan's seeded initialization
    gives) and before the optimizer is built over ``model.parameters()``; then
    :func:`attach` (or ``moe.attach``) the optimizer. torchtitan's own expert parallelism must
    be off (``parallelism.expert_parallel_degree = 1``): Keel places the experts.

    Args:
        model: a torchtitan model (or any module) holding torchtitan ``MoE`` layers whose
            ``routed_experts`` have a ``GroupedExperts`` (``inner_experts``); every layer needs
            the same number of experts, top-k and shapes.
        config, group: :class:`keel.torch.KeelMoE`'s; ``config.topology`` must cover the
            group's ranks.
        keel_moe_args: the other arguments of KeelMoE (``optimizer``, ``dtype``,
            ``average_gradients``, ...). ``device`` defaults to the experts' device.
    """
    layers = moe_layers(model)
    if not layers:
        raise InvalidArgumentError(
            f"model ({type(model).__name__}) holds no torchtitan MoE layer "
            f"(torchtitan.models.common.moe.MoE)")
    shape = None
    stacked: List[Dict[str, torch.Tensor]] = []
    for name, layer in layers:
        routed = layer.routed_experts
        inner = getattr(routed, "inner_experts", None)
        if not isinstance(inner, GroupedExperts):
            raise InvalidArgumentError(
                f"{name}.routed_experts is {type(routed).__name__} without torchtitan's "
                f"GroupedExperts as inner_experts (already Keel's?)")
        if getattr(getattr(routed, "token_dispatcher", None), "ep_mesh", None) is not None:
            raise InvalidArgumentError(
                f"{name} runs torchtitan's expert parallelism (its token dispatcher has an EP "
                f"mesh): set parallelism.expert_parallel_degree = 1; Keel places the experts")
        mine = (type(inner), tuple(inner.w1_EFD.shape), layer.router.top_k)
        if shape is not None and mine != shape:
            raise InvalidArgumentError(
                f"{name}: {mine[0].__name__} of shape {list(mine[1])}, top-{mine[2]}; the first "
                f"MoE layer has {shape[0].__name__} of {list(shape[1])}, top-{shape[2]}: one "
                f"KeelMoE needs the same experts in every layer")
        shape = mine
        stacked.append(_full_experts(name, inner))
    assert shape is not None
    num_experts, top_k = shape[1][0], shape[2]
    spec = grouped_experts_spec(layers[0][1].routed_experts.inner_experts)
    keel_moe_args.setdefault("device", stacked[0]["w1_FD"].device)

    def init_expert(layer: int, expert: int) -> Dict[str, torch.Tensor]:
        return {name: weights[expert] for name, weights in stacked[layer].items()}

    moe = KeelMoE(spec, num_layers=len(layers), num_experts=num_experts, top_k=top_k,
                  group=group, config=config, init_expert=init_expert, **keel_moe_args)
    stacked.clear()  # the slots hold the values now: the replaced weights can go
    for index, (_, layer) in enumerate(layers):
        layer.routed_experts = KeelRoutedExperts(moe.layer(index))
    return moe


def attach(moe: KeelMoE, optimizers: Any) -> None:
    """``moe.attach`` on the optimizer that holds Keel's slots: ``optimizers`` is torchtitan's
    ``OptimizersContainer`` (its ``optimizers``, one per model part and optimizer name, are
    searched) or a ``torch.optim.Optimizer``. torchtitan's expert-bias hook stays on the
    container and runs before the inner optimizers' steps, so before Keel's
    ``reduce_gradients``."""
    candidates = list(getattr(optimizers, "optimizers", None) or [optimizers])
    slot = moe.parameters()[0]
    holding = [o for o in candidates
               if any(p is slot for group in o.param_groups for p in group["params"])]
    if len(holding) != 1:
        raise InvalidArgumentError(
            f"{len(holding)} of the {len(candidates)} optimizers hold Keel's slots; one must "
            f"hold them all (one param group setting: any slot can become any expert's home)")
    moe.attach(holding[0])


__all__ = ["KeelRoutedExperts", "SUPPORTED_VERSIONS", "TORCHTITAN_VERSION", "attach",
           "check_version", "fill_torch_gaps", "grouped_experts_spec", "moe_layers", "use_keel"]
