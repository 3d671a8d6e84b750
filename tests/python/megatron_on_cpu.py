"""Megatron-Core 0.16.1's MoELayer on the CPU, for the tests of keel.integrations.megatron.

Megatron-Core writes CUDA into a few calls of its MoE path; everything else in it is torch
operations that run on the CPU as they are. :func:`answer_cuda_calls_on_the_cpu` answers those
calls for the CPU in this process, and changes no line of Megatron's arithmetic:

- ``torch.cuda.current_device()`` is where Megatron allocates (the router's gating moves its
  weight there; ``tensor_parallel.all_to_all`` makes its output there): the CPU.
- ``torch.cuda.Stream``, ``current_stream`` and ``stream``: the alltoall dispatcher copies its
  split sizes to the host on a side stream and waits for an event; on the CPU the copy is
  already done, so streams and events do nothing.
- ``token_dispatcher.maybe_move_tensor_to_cpu``: the same function (a CUDA tensor to the host,
  ``as_numpy`` as numpy), which on a CPU tensor now also honours ``as_numpy``: the all-to-all's
  split sizes must be numbers, as the GPU path makes them.
- ``moe_utils.te_general_gemm``: megatron-core 0.16.1 defines it only when Transformer Engine
  imports, but the router's gating reads it always; without TE it is None, as the router
  expects (a missing name is a NameError on a GPU machine without TE too).

Call it in each rank process before building a layer.
"""

from __future__ import annotations

from typing import Any


class _Event:
    def synchronize(self) -> None:
        pass


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _Event:
        return _Event()

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *args: Any) -> bool:
        return False


def define_missing_te_general_gemm() -> None:
    """megatron-core 0.16.1's router reads ``moe_utils.te_general_gemm``, which exists only when
    Transformer Engine imports: None is what its code takes for "no TE". On any machine."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def answer_cuda_calls_on_the_cpu() -> None:
    import torch
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *args: _Stream()
    torch.cuda.stream = lambda stream: stream
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _Stream()

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor):
            tensor = tensor.to("cpu")
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    define_missing_te_general_gemm()
