"""keel.torch: Keel inside a PyTorch trainer.

- :class:`KeelMoE`: one engine for every MoE layer of a model, over the trainer's own
  ``torch.distributed`` group; ``moe.layer(l)`` is layer l's :class:`MoEDispatcher` (route,
  all-to-all dispatch, local experts, combine, autograd backward); ``moe.attach(optimizer)``
  installs the hooks that fold replica gradients into homes before ``step()`` and refresh
  replicas after it.
- :func:`ffn_expert` / :class:`ExpertSpec`: what one expert is (parameter shapes, forward).
- :class:`ProcessGroupCommunicator`: the engine's collectives over a process group, with
  deadlines, for trainers that drive :class:`keel.Engine` themselves.

docs/pytorch.md shows the calls in a Megatron-style and a torchtitan-style layer.
"""

from keel.torch.communicator import ProcessGroupCommunicator
from keel.torch.dispatcher import MoEDispatcher, StepTimes
from keel.torch.experts import ExpertSpec, ffn_expert
from keel.torch.moe import KeelMoE

__all__ = ["ExpertSpec", "KeelMoE", "MoEDispatcher", "ProcessGroupCommunicator", "StepTimes",
           "ffn_expert"]
