"""What the keel.integrations tests share: importing a module while package metadata reports
another version of its trainer (or none), which the module must refuse by name; and comparing a
trainer's own MoE layer with the same layer with Keel inside, rank by rank and step by step."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from typing import Any, Dict, Sequence, Tuple

import pytest


def assert_versions_refused(monkeypatch: Any, module: str, distribution: str,
                            cases: Sequence[Tuple[str, str]], supported: str) -> None:
    """Imports ``module`` once per (version, expected) of ``cases`` with ``distribution``
    reported at that version ("" = not installed): each import raises keel.UnimplementedError
    holding ``expected`` and the ``supported`` range. The module is unloaded before and after."""
    import keel
    sys.modules.pop(module, None)
    real = importlib.metadata.version

    def installed(version: str) -> Any:
        def answer(name: str) -> str:
            if name != distribution:
                return real(name)
            if version == "":
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        return answer

    for version, expected in cases:
        monkeypatch.setattr(importlib.metadata, "version", installed(version))
        with pytest.raises(keel.UnimplementedError) as error:
            importlib.import_module(module)
        assert expected in str(error.value), str(error.value)
        assert supported in str(error.value), str(error.value)
        sys.modules.pop(module, None)
    monkeypatch.undo()


def assert_check_version(module: str, trainer_package: str, distribution: str,
                         accepted: Sequence[str], refused: str) -> None:
    """Where the trainer (``trainer_package``) is installed: ``module.check_version`` returns
    each of ``accepted`` as it is and raises keel.UnimplementedError naming ``refused``."""
    import keel
    if importlib.util.find_spec(trainer_package) is None:
        return
    checked = importlib.import_module(module)
    for version in accepted:
        assert checked.check_version(version) == version
    with pytest.raises(keel.UnimplementedError, match=f"{distribution} {refused} is installed"):
        checked.check_version(refused)


def relative(got: Any, want: Any) -> float:
    """The largest difference over ``want``'s largest magnitude (or itself where that is 0: an
    expert no token reached)."""
    scale = float(want.abs().max())
    return float((got - want).abs().max()) / (scale if scale > 0 else 1.0)


def expert_gradients(rank: int, reference_experts: Sequence[Any],
                     dispatcher: Any) -> Dict[str, Dict[int, Dict[str, Any]]]:
    """This rank's expert gradients of one step, on the host, in the shape assert_layers_agree
    reads: the trainer's (``reference_experts``, this expert-parallel rank's local experts, as
    experts ``rank * len(reference_experts) + local``, Keel's parameter names) and Keel's
    homes on this rank (``dispatcher``, a keel.torch.MoEDispatcher, after reduce_gradients)."""
    per_rank = len(reference_experts)
    theirs = {rank * per_rank + local: {n.replace(".", "_"): p.grad.to("cpu", copy=True)
                                        for n, p in expert.named_parameters()}
              for local, expert in enumerate(reference_experts)}
    ours = {e: {n: p.grad.to("cpu", copy=True) for n, p in params.items()}
            for e, params in dispatcher.home_parameters().items()}
    return {"reference": theirs, "keel": ours}


def copies_ran(moe: Any, dispatcher: Any) -> bool:
    """Whether layer 0 of ``moe`` (a keel.torch.KeelMoE) has an expert on more than one slot,
    or this rank's last route (``dispatcher``'s) used a transient replica."""
    persistent = int(moe.engine.placement(0)["logcnt"].max()) > 1
    route = dispatcher.last_route
    return persistent or any(int(e) >= 0
                             for e in route.local_experts[moe.engine.slots_per_rank:])


def assert_layers_agree(by_rank: Sequence[Dict[Any, Any]], cases: Sequence[Any], steps: int,
                        num_experts: int, tolerance: Dict[str, float]) -> Dict[str, float]:
    """Asserts that the trainer's layer and Keel's agreed in every case, on every rank and step,
    within ``tolerance`` (of ``relative``) per quantity; returns the largest difference of each.

    ``by_rank[r][case]`` holds ``differences``, per step a dict quantity -> ``relative``
    difference found on rank r (e.g. output, input and router gradients), and ``gradients``,
    per step ``{"reference": {expert: {name: grad}}, "keel": {...}}`` of the experts rank r
    holds (the trainer's on its expert-parallel rank, Keel's homes): together the ranks must
    hold every expert once on each side, and those are compared under ``tolerance["experts"]``.
    Each case is a tuple whose first item is the placement policy: under ``keel`` a replica or
    transient replica must have run (``copies_ran``, per step) and an epoch been committed
    (``epochs``, rank 0's), under any other none.
    """
    worst: Dict[str, float] = {}
    for case in cases:
        for rank, answer in enumerate(by_rank):
            for step, found in enumerate(answer[case]["differences"]):
                for key, value in found.items():
                    worst[key] = max(worst.get(key, 0.0), value)
                    assert value <= tolerance[key], (case, rank, step, key, found)
        for step in range(steps):
            theirs = {e: g for answer in by_rank
                      for e, g in answer[case]["gradients"][step]["reference"].items()}
            ours = {e: g for answer in by_rank
                    for e, g in answer[case]["gradients"][step]["keel"].items()}
            assert sorted(theirs) == sorted(ours) == list(range(num_experts)), (case, step)
            for e in range(num_experts):
                for name, want in theirs[e].items():
                    value = relative(ours[e][name], want)
                    worst["experts"] = max(worst.get("experts", 0.0), value)
                    assert value <= tolerance["experts"], (case, step, e, name, value)
        ran = [r for answer in by_rank for r in answer[case]["copies_ran"]]
        if case[0] == "keel":
            assert any(ran), f"{case}: no replica or transient replica ran"
            assert by_rank[0][case]["epochs"] >= 1, case
        else:
            assert not any(ran), case
    return worst
