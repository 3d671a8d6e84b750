"""What one expert is: the shapes of its parameters and how it computes. Keel keeps every copy
of an expert (home, replica, transient replica) as one contiguous buffer per slot (of the
experts' dtype, on their device), split into these parameters, so the engine can move and add
whole experts by address."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from keel import _checks
from keel._errors import InvalidArgumentError

Params = Dict[str, torch.Tensor]
# The most values one expert may have: every copy is one buffer, allocated when a KeelMoE is made.
MAX_EXPERT_VALUES = 2 ** 34


class ExpertSpec:
    """One expert's parameters and computation.

    Args:
        shapes: parameter name -> shape, in the order they are packed into a slot's buffer.
        forward: ``forward(params, x) -> y``: ``x`` is ``[rows, input_size]`` (the hidden
            states' dtype), ``y`` ``[rows, output_size]`` of the same dtype; ``params`` maps each
            name to a tensor of its shape in the experts' dtype (which may differ from ``x``'s:
            cast, as :func:`ffn_expert` does).
        init: ``init(generator) -> params`` with every parameter's initial value (float32, on
            the CPU; a CPU ``torch.Generator`` is passed); the same generator state must give
            the same values on every rank.
        input_size, output_size: the widths of ``x`` and ``y`` (the model's hidden size).
    """

    def __init__(self, shapes: Dict[str, Tuple[int, ...]],
                 forward: Callable[[Params, torch.Tensor], torch.Tensor],
                 init: Callable[[torch.Generator], Params], input_size: int,
                 output_size: int) -> None:
        if not isinstance(shapes, dict) or not shapes:
            raise InvalidArgumentError(f"shapes = {_checks.shown(shapes)} must be a dict of "
                                       f"parameter names to shapes: an expert needs parameters")
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        for name, shape in shapes.items():
            _checks.text("a name in shapes", name)
            if not isinstance(shape, (tuple, list)) or not shape:
                raise InvalidArgumentError(
                    f"shapes[{name!r}] = {_checks.shown(shape)} must be a tuple of sizes")
            self.shapes[name] = tuple(_checks.integer(f"shapes[{name!r}][{i}]", d, 1, 2 ** 31 - 1)
                                      for i, d in enumerate(shape))
        for name, function in (("forward", forward), ("init", init)):
            if not callable(function):
                raise InvalidArgumentError(
                    f"{name} must be a callable, got {type(function).__name__}")
        self.forward = forward
        self.init = init
        self.input_size = _checks.integer("input_size", input_size, 1, 2 ** 31 - 1)
        self.output_size = _checks.integer("output_size", output_size, 1, 2 ** 31 - 1)
        self.offsets: Dict[str, Tuple[int, int]] = {}
        at = 0
        for name, shape in self.shapes.items():
            count = math.prod(shape)
            self.offsets[name] = (at, count)
            at += count
        if at > MAX_EXPERT_VALUES:
            raise InvalidArgumentError(
                f"shapes = {_checks.shown(shapes)}: {at} values per expert, more than "
                f"{MAX_EXPERT_VALUES} (2**34, 64 GiB of float32)")
        self.numel = at  # values per slot

    @property
    def names(self) -> List[str]:
        return list(self.shapes)

    def views(self, flat: torch.Tensor) -> Params:
        """Each parameter as a view of a slot's flat buffer ``[numel]``."""
        return {name: flat[at:at + count].view(self.shapes[name])
                for name, (at, count) in self.offsets.items()}

    def pack(self, params: Params, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The parameters as one flat buffer ``[numel]`` (``out``'s dtype and device, else a new
        float32 CPU tensor); checks every name and shape."""
        out = torch.empty(self.numel, dtype=torch.float32) if out is None else out
        missing = set(self.shapes) - set(params)
        if missing:
            raise InvalidArgumentError(f"init gave no value for {sorted(missing)}")
        for name, view in self.views(out).items():
            value = params[name]
            if tuple(value.shape) != self.shapes[name]:
                raise InvalidArgumentError(f"init gave {name} of shape {list(value.shape)}, "
                                           f"expected {list(self.shapes[name])}")
            view.copy_(value)
        return out


def ffn_expert(hidden_size: int, ffn_size: int, activation: str = "gelu") -> ExpertSpec:
    """The usual MoE expert: ``w2(act(w1 x))``, or ``w2(silu(w1 x) * w3 x)`` for ``swiglu``.

    Parameters ``w1`` ``[hidden, ffn]``, ``w2`` ``[ffn, hidden]`` (and ``w3`` ``[hidden, ffn]``),
    initialized like ``torch.nn.Linear`` (uniform in +-1/sqrt(fan_in)).
    """
    activations = {"gelu": torch.nn.functional.gelu, "relu": torch.relu}
    _checks.text("activation", activation, (*activations, "swiglu"))
    hidden_size = _checks.integer("hidden_size", hidden_size, 1, 2 ** 31 - 1)
    ffn_size = _checks.integer("ffn_size", ffn_size, 1, 2 ** 31 - 1)
    shapes: Dict[str, Tuple[int, ...]] = {"w1": (hidden_size, ffn_size),
                                          "w2": (ffn_size, hidden_size)}
    if activation == "swiglu":
        shapes["w3"] = (hidden_size, ffn_size)

    def forward(p: Params, x: torch.Tensor) -> torch.Tensor:
        # In the hidden states' dtype: float32 master weights give bfloat16 products for
        # bfloat16 hidden states, as torch.autocast would.
        w = {name: value.to(x.dtype) for name, value in p.items()}
        if activation == "swiglu":
            return (torch.nn.functional.silu(x @ w["w1"]) * (x @ w["w3"])) @ w["w2"]
        return activations[activation](x @ w["w1"]) @ w["w2"]

    def init(generator: torch.Generator) -> Params:
        out = {}
        for name, shape in shapes.items():
            bound = 1.0 / math.sqrt(shape[0])
            out[name] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
        return out

    return ExpertSpec(shapes, forward, init, hidden_size, hidden_size)
