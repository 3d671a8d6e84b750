"""A trainer's own expert module run on a Keel slot's parameters: what the DeepSpeed and
Megatron-Core integrations share (each trainer keeps its experts as ``torch.nn.Module`` s)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Tuple

import torch

from keel._errors import InvalidArgumentError

#: ``call(slot, x)``: the module's forward on one slot's parameters.
SlotCall = Callable[[Dict[str, torch.Tensor], torch.Tensor], Any]


def module_on_slots(expert: torch.nn.Module) -> Tuple[Dict[str, Tuple[int, ...]], SlotCall]:
    """``expert``'s parameters as a Keel slot's, and its forward on a slot.

    Returns ``(shapes, call)``. ``shapes`` maps each of the module's parameters, in their order
    and named as in ``named_parameters()`` with ``.`` made ``_`` (``linear_fc1.weight`` ->
    ``linear_fc1_weight``: a slot's parameter names have no dots), to its shape. ``call(slot,
    x)`` returns what the module's own forward returns for ``x`` on the slot's tensors
    (``torch.func.functional_call`` on a copy of the module whose parameters are on the meta
    device, so the copy holds no second set of weights). The copy shares the module's attributes
    that are neither tensors, modules nor containers (configs, process groups, functions: a
    process group cannot be copied); its buffers are copies of the module's.

    :class:`keel.InvalidArgumentError` for a non-module, a module without parameters, or
    parameter names that collide once ``.`` is ``_``.
    """
    if not isinstance(expert, torch.nn.Module):
        raise InvalidArgumentError(f"expert is {type(expert).__name__}, not a torch.nn.Module")
    params = dict(expert.named_parameters())
    if not params:
        raise InvalidArgumentError(f"expert ({type(expert).__name__}) has no parameters")
    ours = {name: name.replace(".", "_") for name in params}
    if len(set(ours.values())) < len(ours):
        raise InvalidArgumentError(
            f"expert ({type(expert).__name__}): parameters {sorted(params)} give the same name "
            f"once '.' is '_'")
    # deepcopy takes what the memo holds for an object instead of copying it: the parameters
    # become meta tensors, and the plain attributes stay the module's own.
    memo: Dict[int, Any] = {
        id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                  requires_grad=p.requires_grad) for p in params.values()}
    for module in expert.modules():
        for value in vars(module).values():
            if not isinstance(value, (torch.Tensor, torch.nn.Module, dict, list, tuple, set)):
                memo[id(value)] = value
    template = copy.deepcopy(expert, memo)

    def call(slot: Dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        return torch.func.functional_call(
            template, {theirs: slot[mine] for theirs, mine in ours.items()}, (x,))

    return {ours[name]: tuple(p.shape) for name, p in params.items()}, call
