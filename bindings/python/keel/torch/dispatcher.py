"""MoEDispatcher: one MoE layer through Keel, as a ``torch.nn.Module``.

It takes the router's output and does what a Megatron- or torchtitan-style MoE layer's dispatcher
does: route (the engine picks a physical slot for every token's choice), all-to-all dispatch,
the local experts, all-to-all combine and the weighted sum, each with its autograd backward. Its
slots' expert parameters live in buffers the engine owns by address; :class:`keel.torch.KeelMoE`
makes one dispatcher per layer and drives the optimizer hooks. ``StepTimes`` and ``_LayerClock``
measure the pieces for the example's report.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, NamedTuple, Optional

import numpy
import torch
import torch.distributed as dist

from keel._errors import FailedPreconditionError, InternalError
from keel.engine import check_tensor
from keel.torch.mp_groups import GatherShares, MpGroup, ShareOf
from keel.torch.routing import count_experts, dispatch_order, slot_major_order

if TYPE_CHECKING:
    from keel.torch.moe import KeelMoE


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
