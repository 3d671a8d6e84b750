"""KeelMoE: Keel for the MoE layers of a PyTorch model.

One :class:`keel.Engine` serves every MoE layer. Each layer's :class:`MoEDispatcher` takes the
router's output and does what a Megatron- or torchtitan-style MoE layer's dispatcher does (route,
all-to-all dispatch, local experts, all-to-all combine, weighted sum), with an autograd backward.
Expert weights live in per-slot parameters whose memory the engine owns by address; the optimizer
hooks (:meth:`KeelMoE.attach`) fold replica gradients into the homes before ``optimizer.step()``
and push the homes' new weights to the replicas after it.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

import numpy
import torch
import torch.distributed as dist

from keel import _checks
from keel._errors import FailedPreconditionError, InternalError, InvalidArgumentError
from keel.engine import Engine, check_tensor
from keel.torch.communicator import ProcessGroupCommunicator, wait_for_stream
from keel.torch.experts import ExpertSpec
from keel.torch.mp_groups import (GatherShares, MpGroup, ShareOf, check_mp_group_size,
                                  make_mp_group)
from keel.torch.routing import count_experts, dispatch_order, slot_major_order


class StepTimes:
    """CPU seconds of one step on this rank, per layer, the way separate GPUs would see them:
    ``expert`` is the calling thread's time in the experts (forward and backward; run torch with
    one intra-op thread), ``communication`` the process's time in route and the all-to-alls,
    ``control`` in reduce_gradients, the optimizer and step_end."""

    def __init__(self, num_layers: int) -> None:
        self.expert = [0.0] * num_layers
        self.communication = [0.0] * num_layers
        self.route = 0.0
        self.control = 0.0
        # The calling thread's share of route and of the all-to-alls, so that a trainer can tell
        # the rest of its own thread's time (attention, router, Python) apart.
        self.route_thread = 0.0
        self.exchange_thread = 0.0
        # The dispatchers' own work on the calling thread, route included, experts and
        # all-to-alls not: Keel's bookkeeping in Python (sorting, index building, gathers).
        self.dispatch = 0.0
        self.rows = [0] * num_layers  # rows this rank's experts computed, per layer


class _AllToAll(torch.autograd.Function):
    """Rows to every rank by split sizes; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: List[int], recv: List[int],
                exchange: Callable[[torch.Tensor, List[int], List[int]], torch.Tensor]) -> Any:
        ctx.send, ctx.recv, ctx.exchange = send, recv, exchange
        return exchange(rows, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return ctx.exchange(grad.contiguous(), ctx.recv, ctx.send), None, None, None


class _PermuteRows(torch.autograd.Function):
    """``rows[index]`` where ``index`` takes every row of ``rows`` once, except that several
    entries may read the last row (the zero row of dropped entries, whose gradient nobody
    uses). Backward writes each gradient row to its place, where ``index_select``'s own
    backward would add them (a zero-filled tensor and atomic adds)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (index,) = ctx.saved_tensors
        out = grad.new_empty((ctx.num_rows,) + tuple(grad.shape[1:]))
        return out.index_copy_(0, index, grad), None


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls ``hook`` when gradients pass: marks where the experts'
    backward starts and ends, for timing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Callable[[], None]) -> torch.Tensor:
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.hook()
        return grad, None


class _CondensedExperts(torch.autograd.Function):
    """One layer's dispatch, experts and combine with token condensation (docs/luffy.md).

    Forward: in each (destination rank, local slot) bucket, the rows that repeat an earlier row
    (``keel.condense_rows``) are not sent; each rank computes the rows it receives once and the
    outputs come back to every row they stand for. Backward, by the rule of kernels/condense.h:
    every row keeps its own output gradient and goes back through its representative's forward,
    so repeated rows (threshold 1.0) train as without condensation. The backward sends every
    row's gradient and recomputes the experts' forward on every row it received."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, dispatcher: "MoEDispatcher", keys: torch.Tensor,
                send: List[int], recv: List[int], recv_counts: torch.Tensor) -> Any:
        import keel  # the package's condense_rows; keel.torch is imported from it
        moe = dispatcher._moe
        local_slots, ranks = moe.engine.local_slots, moe.engine.num_ranks
        exchange = moe.exchange(dispatcher.layer)
        count = rows.shape[0]
        # Buckets: the rows of one (destination rank, local slot), contiguous in dispatch order.
        begin = torch.zeros(ranks * local_slots + 1, dtype=torch.int64)
        begin[1:] = torch.cumsum(torch.bincount(keys, minlength=ranks * local_slots), 0)
        representative, _ = keel.condense_rows(rows.detach(), begin, moe.condense_threshold,
                                               moe.condense_window)
        representative = representative.long()
        leader = representative == torch.arange(count)
        # Kept rows are numbered per destination in dispatch order; a condensed row takes its
        # representative's number.
        destination = torch.div(keys, local_slots, rounding_mode="floor")
        before = torch.zeros(count + 1, dtype=torch.int64)
        before[1:] = torch.cumsum(leader.long(), 0)
        kept_index = (before[:-1] - before[begin[destination * local_slots]])[representative]
        kept_to = torch.bincount(destination[leader], minlength=ranks).tolist()
        # Which kept row each received row is, then the kept rows.
        received_index = exchange(kept_index.to(torch.int32), send, recv).long()
        kept_from = []
        offset, at = 0, 0
        for source in range(ranks):
            segment = received_index[at:at + recv[source]]
            received_index[at:at + recv[source]] += offset
            kept = int(segment.max()) + 1 - offset if recv[source] > 0 else 0
            kept_from.append(kept)
            offset += kept
            at += recv[source]
        kept_inputs = exchange(rows.detach()[leader].contiguous(), kept_to, kept_from)
        # Received rows come grouped by source rank, then local slot.
        slot = torch.arange(local_slots).repeat(ranks).repeat_interleave(recv_counts.reshape(-1))
        kept_slot = torch.full((offset,), -1, dtype=torch.int64)
        kept_slot[received_index] = slot
        started = time.thread_time()
        kept_outputs = kept_inputs.new_zeros((offset, moe.spec.output_size))
        with torch.no_grad():
            for local in range(local_slots):
                chosen = (kept_slot == local).nonzero().squeeze(1)
                if chosen.numel() > 0:
                    params = dispatcher._params[local]
                    kept_outputs[chosen] = moe.spec.forward(params, kept_inputs[chosen])
        if moe.times is not None:
            moe.times.expert[dispatcher.layer] += time.thread_time() - started
        returned = exchange(kept_outputs, kept_from, kept_to)
        kept_begin = torch.zeros(ranks, dtype=torch.int64)
        kept_begin[1:] = torch.cumsum(torch.tensor(kept_to, dtype=torch.int64), 0)[:-1]
        moe.condensation_rows[1] += int(leader.sum())
        ctx.dispatcher, ctx.send, ctx.recv = dispatcher, send, recv
        ctx.save_for_backward(kept_inputs, received_index, slot)
        return returned[kept_begin[destination] + kept_index]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        dispatcher = ctx.dispatcher
        moe = dispatcher._moe
        kept_inputs, received_index, slot = ctx.saved_tensors
        exchange = moe.exchange(dispatcher.layer)
        received_grad = exchange(grad.contiguous(), ctx.send, ctx.recv)
        started = time.thread_time()
        inputs = kept_inputs[received_index].detach().requires_grad_()
        outputs, grads = [], []
        with torch.enable_grad():
            for local in range(moe.engine.local_slots):
                chosen = (slot == local).nonzero().squeeze(1)
                if chosen.numel() > 0:
                    params = dispatcher._params[local]
                    outputs.append(moe.spec.forward(params, inputs[chosen]))
                    grads.append(received_grad[chosen])
            if outputs:
                torch.autograd.backward(outputs, grads)
        input_grad = inputs.grad if inputs.grad is not None else torch.zeros_like(inputs)
        if moe.times is not None:
            moe.times.expert[dispatcher.layer] += time.thread_time() - started
        return exchange(input_grad, ctx.recv, ctx.send), None, None, None, None, None


class _Share(NamedTuple):
    """This member's share of its MP group's tokens in one layer call."""

    begin: int
    end: int
    tokens: int  # the group's
    agreement: Callable[[], torch.Tensor]  # gathers every rank's MpGroup.signature


class _SavedRouting:
    """One forward's routing of a layer in the step under way, kept for the forward that
    activation checkpointing recomputes in backward: the same slots and splits as the saved
    all-to-alls expect, and no second route."""

    def __init__(self, topk_ids: torch.Tensor, route: Any, dispatch: Any) -> None:
        self.topk_ids, self.route, self.dispatch = topk_ids, route, dispatch
        self.recomputed = False


class _DispatcherState:
    """A dispatcher's state dict by logical expert: ``experts.{e}.{name}`` for every expert
    that has a persistent copy on this rank (its home's values, or its first copy's: replicas
    equal their home after ``step_end``), never the placement-dependent slot parameters. Loading
    fills every persistent copy of each expert this rank holds, under whatever placement is in
    force; a checkpoint with a missing, misshapen or unknown entry changes nothing of the layer
    (with ``strict``)."""

    @staticmethod
    def save(dispatcher: "MoEDispatcher", state: Dict[str, Any], prefix: str,
             local_metadata: Any) -> None:
        for key in [k for k in state if k.startswith(prefix + "slots.")]:
            del state[key]
        for expert, slots in sorted(dispatcher.held_experts().items()):
            for name, param in dispatcher._params[slots[0]].items():
                state[f"{prefix}experts.{expert}.{name}"] = param.detach()

    @staticmethod
    def load(dispatcher: "MoEDispatcher", state: Dict[str, Any], prefix: str,
             local_metadata: Any, strict: bool, missing_keys: List[str],
             unexpected_keys: List[str], error_msgs: List[str]) -> None:
        found, missing, unexpected, errors = dispatcher.expert_entries(state, prefix)
        missing_keys.extend(missing)
        unexpected_keys.extend(unexpected)
        error_msgs.extend(errors)
        for key in [k for k in state if k.startswith(prefix + "experts.")]:
            del state[key]
        load = not errors and not (strict and (missing or unexpected))
        # Every slot parameter gets an entry: the checkpoint's value, or its own (unchanged).
        held = {local: expert for expert, slots in dispatcher.held_experts().items()
                for local in slots}
        for local, params in enumerate(dispatcher._params):
            for name, param in params.items():
                value = found.get((held.get(local, -1), name)) if load else None
                state[f"{prefix}slots.{local}.{name}"] = param.detach() if value is None else value


class MoEDispatcher(torch.nn.Module):
    """One MoE layer's dispatcher and its slots' expert parameters (a ``torch.nn.Module``; put it
    in your model so that ``model.parameters()`` includes the slots).

    ``forward(hidden, topk_ids, topk_weights) -> out``, every tensor on the device of the
    :class:`KeelMoE` (CPU or CUDA):

    - ``hidden``: ``[num_tokens, input_size]`` float32, bfloat16 or float16, this rank's tokens.
    - ``topk_ids``: ``[num_tokens, top_k]`` int64 or int32, the router's expert per choice
      (``-1`` drops a choice).
    - ``topk_weights``: ``[num_tokens, top_k]`` float32, bfloat16 or float16, the router's gate
      weight per choice (gradients flow back into it).
    - ``out``: ``[num_tokens, output_size]`` of ``hidden``'s dtype, ``sum_k topk_weights[t, k] *
      expert[topk_ids[t, k]](hidden[t])``, what a dense MoE layer gives. The experts compute in
      ``hidden``'s dtype (:func:`keel.torch.ffn_expert` casts its weights to it), and the
      weighted sum over k takes float32 products and sums, rounded once to that dtype.

    Collective: every rank calls every layer in the same order, forward and backward.

    A layer may run any number of forwards between two optimizer steps: micro-batches of
    gradient accumulation or of a pipeline schedule, in flight at once in any order, and
    evaluation passes (no extra call). Each is routed on its own; its backward uses what its
    forward routed, and the slot gradients add up until the optimizer step. A forward that
    ``torch.utils.checkpoint`` recomputes during backward (reentrant or not) reuses the routing
    of the forward with the same ``topk_ids`` instead of routing again.
    """

    _FLOATS = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, moe: "KeelMoE", layer: int) -> None:
        super().__init__()
        self._moe = moe  # a plain attribute: the model's modules are the dispatchers, not KeelMoE
        self.layer = layer
        spec = moe.spec
        engine = moe.engine
        self.slots = torch.nn.ModuleList()
        self.last_route: Optional[Any] = None
        self._routings: List[_SavedRouting] = []  # this step's training forwards, for recompute
        self._weights: List[torch.Tensor] = []
        self._gradients: List[torch.Tensor] = []
        self._optimizer: List[Optional[torch.Tensor]] = []
        # Per slot, built once (the hooks run every step): name -> parameter, name -> its
        # gradient's view of the slot's gradient buffer.
        self._params: List[Dict[str, torch.nn.Parameter]] = []
        self._grad_views: List[Dict[str, torch.Tensor]] = []
        placement = engine.placement(layer)["phy2log"]
        rank, per_rank = engine.rank, engine.slots_per_rank
        for local in range(engine.local_slots):
            weights = torch.zeros(spec.numel, dtype=moe.dtype, device=moe.device)
            gradients = torch.zeros(spec.numel, dtype=moe.dtype, device=moe.device)
            persistent = local < per_rank
            optimizer = (torch.zeros(moe.optimizer_bytes, dtype=torch.uint8, device=moe.device)
                         if persistent and moe.optimizer_bytes > 0 else None)
            slot = torch.nn.ParameterDict()
            for name, view in spec.views(weights).items():
                slot[name] = torch.nn.Parameter(view)
            self.slots.append(slot)
            if persistent:
                expert = int(placement[rank * per_rank + local])
                if expert >= 0:
                    spec.pack(moe.initial_expert(layer, expert), out=weights)
            engine.register_slot(layer, local, weights, gradients, optimizer)
            self._weights.append(weights)
            self._gradients.append(gradients)
            self._optimizer.append(optimizer)
            self._params.append(dict(slot.items()))
            self._grad_views.append(spec.views(gradients))
        self.attach_gradients()
        # The state dict is by logical expert, whatever the placement (checkpoints below).
        post_hook = getattr(self, "register_state_dict_post_hook", None)
        (post_hook or self._register_state_dict_hook)(_DispatcherState.save)
        self.register_load_state_dict_pre_hook(_DispatcherState.load)
        self.register_load_state_dict_post_hook(
            lambda module, _: module._moe.synchronize("loading the experts"))

    # --- checkpoints ----------------------------------------------------------------------------
    def held_experts(self) -> Dict[int, List[int]]:
        """expert -> this rank's persistent slots that hold it under the placement in force, its
        home slot first."""
        engine = self._moe.engine
        held: Dict[int, List[int]] = {}
        phy2log = engine.placement(self.layer)["phy2log"]
        first = engine.rank * engine.slots_per_rank
        for local in range(engine.slots_per_rank):
            expert = int(phy2log[first + local])
            if expert >= 0:
                held.setdefault(expert, []).append(local)
        for expert, local in engine.home_slots(self.layer):
            held[expert].remove(local)
            held[expert].insert(0, local)
        return held

    def expert_entries(self, state: Dict[str, Any], prefix: str) -> Any:
        """Reads this layer's ``{prefix}experts.{e}.{name}`` entries of ``state`` without
        changing anything: (expert, name) -> tensor for the experts this rank holds, the keys of
        those missing, the keys that name no expert or parameter, and what else is wrong
        (shape, dtype), each naming its key."""
        spec, num_experts = self._moe.spec, self._moe.num_experts
        held = self.held_experts()
        found: Dict[Any, torch.Tensor] = {}
        unexpected, errors = [], []
        start = prefix + "experts."
        for key, value in state.items():
            if not key.startswith(start):
                continue
            expert_text, _, name = key[len(start):].partition(".")
            if not expert_text.isdigit() or int(expert_text) >= num_experts \
                    or name not in spec.shapes:
                unexpected.append(key)
                continue
            expert = int(expert_text)
            if expert not in held:
                continue  # another rank's expert: a whole checkpoint has every expert
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                errors.append(f"{key}: expected a floating-point tensor, got "
                              f"{getattr(value, 'dtype', type(value).__name__)}")
            elif tuple(value.shape) != spec.shapes[name]:
                errors.append(f"{key}: shape {list(value.shape)} in the checkpoint, "
                              f"{list(spec.shapes[name])} in the model")
            else:
                found[(expert, name)] = value
        missing = [f"{start}{expert}.{name}" for expert in sorted(held) for name in spec.names
                   if (expert, name) not in found and not any(
                       e.startswith(f"{start}{expert}.{name}:") for e in errors)]
        return found, missing, unexpected, errors

    # --- gradients ------------------------------------------------------------------------------
    def attach_gradients(self) -> None:
        """Clears every slot parameter's ``.grad`` for the next backward: autograd then hands
        over the gradients it computed (accumulating only across backward passes), where a
        gradient already in place would cost an add per parameter."""
        for params in self._params:
            for param in params.values():
                param.grad = None

    def collect_gradients(self) -> None:
        """Brings the gradients autograd left in ``.grad`` into the slot buffers the engine reads
        (zeros where a parameter has none: its slot got no rows), in one copy and one fill over
        all of them, and points each ``.grad`` at its place in the buffer."""
        copy_to, copy_from, zero = [], [], []
        for params, views in zip(self._params, self._grad_views):
            for name, param in params.items():
                grad, view = param.grad, views[name]
                if grad is None:
                    zero.append(view)
                elif grad is not view:
                    copy_to.append(view)
                    copy_from.append(grad)
                param.grad = view
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)
        if zero:
            torch._foreach_zero_(zero)

    def keep_home_gradients(self, scale: float) -> List[int]:
        """After the engine's reduction: homes keep their (scaled) gradients for the optimizer,
        every other slot's parameters get ``.grad = None`` so that the optimizer skips them.
        Returns the home slots."""
        homes = sorted(local for _, local in self._moe.engine.home_slots(self.layer))
        if scale != 1.0 and homes:
            torch._foreach_mul_([self._gradients[local] for local in homes], scale)
        chosen = set(homes)
        for local, (params, views) in enumerate(zip(self._params, self._grad_views)):
            for name, param in params.items():
                param.grad = views[name] if local in chosen else None
        return homes

    def home_parameters(self) -> Dict[int, Dict[str, torch.nn.Parameter]]:
        """expert -> its parameters, for this rank's home slots of this layer."""
        return {expert: dict(self._params[local])
                for expert, local in self._moe.engine.home_slots(self.layer)}

    def optimizer_state_views(self, local: int) -> Dict[str, Dict[str, torch.Tensor]]:
        """name -> the Adam state of that parameter of persistent slot ``local``, as views of the
        slot's optimizer buffer (which the engine moves with the home): ``step`` a float32
        scalar, ``exp_avg`` and ``exp_avg_sq`` of the parameter's dtype and shape, packed per
        parameter in that order."""
        buffer = self._optimizer[local]
        spec = self._moe.spec
        element = self._moe.element_size
        out = {}
        at = 0
        for name, (_, count) in spec.offsets.items():
            moment = count * element
            out[name] = {
                "step": buffer[at:at + 4].view(torch.float32).view(()),
                "exp_avg": buffer[at + 4:at + 4 + moment].view(self._moe.dtype)
                .view(spec.shapes[name]),
                "exp_avg_sq": buffer[at + 4 + moment:at + 4 + 2 * moment].view(self._moe.dtype)
                .view(spec.shapes[name])}
            at += 4 + 2 * moment
        return out

    # --- forward --------------------------------------------------------------------------------
    # torch.compile runs the dispatch as it is (a graph break on each side): its collectives,
    # host-side routing and autograd functions are not traceable, and gain nothing from tracing.
    @torch.compiler.disable
    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        moe = self._moe
        spec = moe.spec
        check_tensor("hidden", hidden, self._FLOATS, shape=(None, spec.input_size),
                     device=moe.device)
        tokens = hidden.shape[0]
        check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64),
                     shape=(tokens, moe.top_k), device=moe.device)
        check_tensor("topk_weights", topk_weights, self._FLOATS, shape=(tokens, moe.top_k),
                     device=moe.device)
        clock = _LayerClock(moe.times, self.layer)
        if moe.mp is None:
            out = self._dispatch(hidden, topk_ids, topk_weights, clock)
        else:
            out = self._dispatch_share(hidden, topk_ids, topk_weights, clock)
        clock.end_dispatch()
        return out

    def _dispatch_share(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, clock: "_LayerClock") -> torch.Tensor:
        """With MP groups: this member's share of the group's tokens through the dispatch, then
        every member's outputs all-gathered; the gradients of keel/torch/mp_groups.py. The
        members first agree that they pass the same tokens (their count, dtypes and router
        output), in the route's one copy to the host."""
        moe = self._moe
        mp = moe.mp
        assert mp is not None
        tokens = hidden.shape[0]
        begin, end = mp.share(tokens)
        gather = moe.gather_shares(self.layer, tokens)
        share = _Share(begin, end, tokens,
                       lambda: self._member_signatures(hidden, topk_ids, topk_weights))
        out = self._dispatch(ShareOf.apply(hidden, begin, end, gather), topk_ids[begin:end],
                             ShareOf.apply(topk_weights, begin, end, gather), clock, share)
        return GatherShares.apply(out, begin, end, gather)

    def _member_signatures(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor) -> torch.Tensor:
        """``[ranks, 4]`` int64 on the device: every rank's ``MpGroup.signature``, gathered over
        the whole group so that a disagreement in one MP group fails every rank."""
        moe = self._moe
        assert moe.mp is not None
        mine = moe.mp.signature(hidden, topk_ids, topk_weights)
        parts = [torch.empty_like(mine) for _ in range(moe.engine.num_ranks)]
        moe._wait(dist.all_gather(parts, mine, group=moe.group, async_op=True),
                  f"layer {self.layer} MP groups' agreement")
        return torch.stack(parts)

    def _dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, clock: "_LayerClock",
                  share: Optional["_Share"] = None) -> torch.Tensor:
        """Route, dispatch, experts and combine of ``hidden``'s tokens: this rank's, or its
        ``share`` of its MP group's."""
        moe = self._moe
        tokens = hidden.shape[0]
        with clock.route():
            route, dispatch = self._routing(topk_ids, share)
        self.last_route = route
        send = route.send_counts.tolist()
        recv = route.recv_totals.tolist()
        token = torch.div(dispatch.order, moe.top_k, rounding_mode="floor")
        moe.condensation_rows[0] += dispatch.order.numel()
        clock.count_rows(route)
        if moe.condense_threshold > 0:
            keys = torch.from_numpy(moe.slot_keys[dispatch.slot.long().numpy()])[dispatch.order]
            returned = _CondensedExperts.apply(hidden.index_select(0, token), self, keys, send,
                                               recv, route.recv_counts)
        else:
            moe.condensation_rows[1] += dispatch.order.numel()
            returned = self._exchange_and_compute(hidden.index_select(0, token), route, send,
                                                  recv, clock)
        return self._combine(returned, dispatch, topk_weights, tokens)

    def _routing(self, topk_ids: torch.Tensor, share: Optional["_Share"] = None) -> Any:
        """This forward's routing: the engine's, or in a forward recomputed during backward (the
        autograd engine is running a node on this thread), the routing its first forward got
        (whose MP group members agreed already)."""
        if torch._C._current_autograd_node() is not None:
            return self._recomputed_routing(topk_ids)
        route, dispatch = self._route(topk_ids, share)
        if self.training:
            self._routings.append(_SavedRouting(topk_ids.detach(), route, dispatch))
        return route, dispatch

    def _recomputed_routing(self, topk_ids: torch.Tensor) -> Any:
        """The step's first routing whose router output equals ``topk_ids``, those not
        recomputed yet first (two micro-batches with the same output route alike anyway)."""
        for saved in sorted(self._routings, key=lambda saved: saved.recomputed):
            if (saved.topk_ids.shape == topk_ids.shape and saved.topk_ids.dtype == topk_ids.dtype
                    and torch.equal(saved.topk_ids, topk_ids)):
                saved.recomputed = True
                return saved.route, saved.dispatch
        raise FailedPreconditionError(
            f"layer {self.layer}: a forward recomputed during backward has router output that "
            f"no forward of this step had (of {len(self._routings)} routed in training mode): "
            f"the recomputed router must give the same top-k (torch.utils.checkpoint restores "
            f"the RNG state by default; keep preserve_rng_state=True), and the first forward "
            f"must run in training mode")

    def end_step(self) -> None:
        """Forgets the step's routings: the next forwards belong to the next step."""
        self._routings.clear()

    def _route(self, topk_ids: torch.Tensor, share: Optional["_Share"] = None) -> Any:
        """The engine's routing of this layer and every entry's place in the dispatch. With MP
        groups (``share``, ``topk_ids`` being the share's) the members' signatures come to the
        host with the counts and are checked before the engine routes, and the route answers
        the group's tokens as ``Engine.route`` does: slot -1 outside the share."""
        moe = self._moe
        signatures = share.agreement() if share is not None else None
        count = count_experts(topk_ids, moe.num_experts, moe.collective_timeout, signatures)
        if share is not None:
            assert moe.mp is not None and signatures is not None
            moe.mp.check_signatures(self.layer, count.extra.view(signatures.shape))
        route = moe.engine.route_counts(self.layer, count.counts_E)
        dispatch = dispatch_order(count, route.copy_begin, route.copy_slot, route.copy_quota,
                                  moe.slot_keys, topk_ids.numel())
        slot = dispatch.slot.view(topk_ids.shape)
        if share is None:
            return route._replace(slot=slot), dispatch
        group_slot = torch.full((share.tokens, moe.top_k), -1, dtype=torch.int32,
                                device=slot.device)
        group_slot[share.begin:share.end] = slot
        return route._replace(slot=group_slot, share_begin=share.begin,
                              share_end=share.end), dispatch

    def _exchange_and_compute(self, rows: torch.Tensor, route: Any, send: List[int],
                              recv: List[int], clock: "_LayerClock") -> torch.Tensor:
        """Rows to their slots' ranks, through this rank's experts, and back (dispatch order)."""
        moe = self._moe
        exchange = moe.exchange(self.layer)
        received = _AllToAll.apply(rows, send, recv, exchange)
        # Received rows come grouped by source rank, then local slot; the experts want them
        # grouped by slot. One rank: already so.
        counts = route.recv_counts
        by_slot = None
        if moe.engine.num_ranks > 1:
            by_slot = slot_major_order(counts.numpy(), moe.device)
            received = received.index_select(0, by_slot)
        computed = clock.experts(lambda x: self._experts(x, counts.sum(0).tolist(), route),
                                 received)
        if by_slot is not None:
            back = torch.empty_like(by_slot)
            back[by_slot] = torch.arange(by_slot.numel(), device=by_slot.device)
            computed = computed.index_select(0, back)
        return _AllToAll.apply(computed, recv, send, exchange)

    def _experts(self, inputs: torch.Tensor, slot_rows: List[int], route: Any) -> torch.Tensor:
        """Each local slot's expert on its rows (``inputs`` grouped by slot). One split, not a
        slice per slot: the backward of a slice is a zero-filled tensor of the whole input, so
        slices would cost every slot a pass over all the rows."""
        spec = self._moe.spec
        outputs = []
        for local, (rows, part) in enumerate(zip(slot_rows, inputs.split(slot_rows))):
            if rows == 0:
                continue
            if route.local_experts[local] < 0:
                raise InternalError(f"layer {self.layer}: {rows} rows routed to local slot "
                                    f"{local} of rank {self._moe.engine.rank}, which holds no "
                                    f"expert")
            outputs.append(spec.forward(self._params[local], part))
        if not outputs:
            # No rows for this rank, but its empty output must still depend on the received
            # rows and on slot parameters, as every other rank's does, so that backward runs
            # this rank's part of both all-to-alls, which every rank must join. (Not the expert
            # on no rows: some grouped GEMMs refuse empty inputs in backward.)
            anchor = sum(p.sum() for p in self._params[0].values()).to(inputs.dtype)
            return inputs.sum(1, keepdim=True).expand(-1, spec.output_size) + anchor
        return torch.cat(outputs)

    def _combine(self, returned: torch.Tensor, dispatch: Any, topk_weights: torch.Tensor,
                 tokens: int) -> torch.Tensor:
        """``out[t] = sum_k topk_weights[t, k] * returned[row of (t, k)]``: the rows back in
        entry order (a dropped entry reads a zero row), then the products in float32 summed
        over k in a fixed order (no scattered adds) and rounded once to the rows' dtype."""
        top_k = self._moe.top_k
        rows = returned
        if dispatch.position.numel() > returned.shape[0]:  # dropped entries read the zero row
            rows = torch.cat([returned, returned.new_zeros((1, returned.shape[1]))])
        width = rows.shape[1]
        rows_TKD = _PermuteRows.apply(rows, dispatch.position).view(tokens, top_k, width)
        weights_TK1 = topk_weights.view(tokens, top_k, 1).float()
        return (rows_TKD * weights_TK1).sum(1).to(rows.dtype)


class _LayerClock:
    """One layer call's share of :class:`StepTimes`, when the trainer asked for them
    (``KeelMoE.times``): route, all-to-all and expert time, and the dispatcher's own work on
    the calling thread (what is left of its thread time). CPU clocks: on a GPU they measure the
    host's side only."""

    def __init__(self, times: Optional[StepTimes], layer: int) -> None:
        self.times, self.layer = times, layer
        if times is not None:
            self.entered = time.thread_time()
            self.before = times.expert[layer] + times.exchange_thread

    @contextlib.contextmanager
    def route(self) -> Iterator[None]:
        started, started_thread = time.process_time(), time.thread_time()
        yield
        if self.times is not None:
            elapsed = time.process_time() - started
            self.times.route += elapsed
            self.times.communication[self.layer] += elapsed
            self.times.route_thread += time.thread_time() - started_thread

    def count_rows(self, route: Any) -> None:
        if self.times is not None:
            self.times.rows[self.layer] += int(route.recv_counts.sum())

    def experts(self, run: Callable[[torch.Tensor], torch.Tensor],
                inputs: torch.Tensor) -> torch.Tensor:
        """``run(inputs)``, its forward and backward counted as expert time."""
        if self.times is None:
            return run(inputs)
        moe_times, layer = self.times, self.layer
        clock = [0.0]

        def start() -> None:
            clock[0] = time.thread_time()

        def stop() -> None:
            moe_times.expert[layer] += time.thread_time() - clock[0]

        inputs = _OnBackward.apply(inputs, stop)
        started = time.thread_time()
        outputs = run(inputs)
        moe_times.expert[layer] += time.thread_time() - started
        return _OnBackward.apply(outputs, start)

    def end_dispatch(self) -> None:
        if self.times is not None:
            spent_elsewhere = (self.times.expert[self.layer] + self.times.exchange_thread
                               - self.before)
            self.times.dispatch += time.thread_time() - self.entered - spent_elsewhere


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
        mp_group_size = _checks.integer("mp_group_size", mp_group_size, 1, 2 ** 31 - 1)
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
        parameters: neither their state nor their places in the param groups."""
        slots = {id(p) for p in self._slot_parameters()}
        ours = set()
        groups = []
        for group, packed in zip(optimizer.param_groups, state_dict["param_groups"]):
            pairs = list(zip(group["params"], packed["params"]))
            ours.update(index for param, index in pairs if id(param) in slots)
            groups.append({**packed, "params": [i for p, i in pairs if id(p) not in slots]})
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
            params = []
            for param in group["params"]:
                if id(param) in slots:
                    params.append(fresh)
                    ours.add(fresh)
                    fresh += 1
                else:
                    params.append(next(saved))
            groups.append({**packed, "params": params})
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
