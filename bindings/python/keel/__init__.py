"""Keel keeps Mixture-of-Experts training balanced across GPUs.

This package binds Keel's C++ library (include/keel/) for Python:

- :class:`Config`: the configuration (docs/config.md), read from YAML, a file or a dict and
  validated; errors name the key, the value and the line.
- :func:`plan`: one placement per layer from a per-expert load, with the inputs and outputs of
  DeepSeek EPLB's ``rebalance_experts`` (``phy2log``, ``log2phy``, ``logcnt``), for any policy.
- :func:`read_trace`, :func:`synthetic_trace`, :func:`replay`: routing traces and the offline
  replay of ``keel replay``, whose report comes back as a dict.
- :class:`Engine`: the per-step runtime a trainer embeds (route, reduce_gradients, step_end,
  plan_sequences), over any communicator object; :mod:`keel.torch` runs it over a
  ``torch.distributed`` group and adds the MoE dispatcher and optimizer hooks.
- :func:`condense_rows`: Luffy's token condensation rule on CPU rows (docs/luffy.md).

Every failure raises a :class:`KeelError` subclass that is also the matching built-in exception
(``ValueError`` for a bad argument, ``FileNotFoundError``, ``TimeoutError``...).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from keel import _checks, _keel
from keel._errors import (AbortedError, DeadlineExceededError, FailedPreconditionError,
                          InternalError, InvalidArgumentError, IoError, KeelError, NotFoundError,
                          OutOfRangeError, UnimplementedError)
from keel.engine import Engine, Route, SequencePlacement, check_tensor, to_int32

__version__: str = _keel.__version__

__all__ = [
    "AbortedError", "Config", "DeadlineExceededError", "Engine", "FailedPreconditionError",
    "InternalError", "InvalidArgumentError", "IoError", "KeelError", "NotFoundError",
    "OutOfRangeError", "Route", "SequencePlacement", "Trace", "UnimplementedError",
    "condense_rows", "load_config", "plan", "policy_names", "read_trace", "replay",
    "synthetic_trace",
]


class Config:
    """Keel's configuration (docs/config.md): every key typed, defaulted and documented.

    Build one with :meth:`from_yaml`, :meth:`from_file` or :meth:`from_dict`; ``Config()`` has
    every key at its default. Unknown keys and bad values raise :class:`InvalidArgumentError`
    naming the key, the value and the line (``"mine.yaml:3: policy.name: ..."``).
    """

    def __init__(self, _native: Optional[_keel.Config] = None) -> None:
        self._native = _native if _native is not None else _keel.Config()

    @classmethod
    def from_yaml(cls, text: str, source: str = "<config>") -> "Config":
        """Parses and validates YAML text; ``source`` names it in error messages."""
        return cls(_keel.Config.from_yaml(_checks.text("text", text),
                                          _checks.text("source", source)))

    @classmethod
    def from_file(cls, path: str) -> "Config":
        """Reads a YAML file (a str or os.PathLike). :class:`NotFoundError` when it does not
        exist."""
        return cls(_keel.Config.from_file(_checks.path("path", path)))

    @classmethod
    def from_dict(cls, values: Dict[str, Any], source: str = "<dict>") -> "Config":
        """A config from nested dicts, e.g. ``{"policy": {"name": "static"}}``; keys left out keep
        their defaults."""
        if not isinstance(values, dict):
            raise InvalidArgumentError(f"values must be a dict, got {type(values).__name__}")
        # JSON is YAML: the library's reader checks every key and value.
        try:
            text = json.dumps(values, indent=1, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as error:
            raise InvalidArgumentError(f"values cannot be a config: {error}") from None
        return cls.from_yaml(text, source)

    @staticmethod
    def reference() -> str:
        """Every key with its type, default and meaning (the text of ``keel config --help``)."""
        return _keel.Config.reference()

    def to_yaml(self) -> str:
        """A complete YAML document, every key documented; :meth:`from_yaml` reads it back."""
        return self._native.to_yaml()

    def to_dict(self) -> Dict[str, Any]:
        """Every key as nested dicts (needs PyYAML)."""
        return _load_yaml(self.to_yaml())

    def replace(self, values: Dict[str, Any]) -> "Config":
        """A copy with the keys of ``values`` (nested dicts) replaced."""
        if not isinstance(values, dict):
            raise InvalidArgumentError(f"values must be a dict, got {type(values).__name__}")
        merged = self.to_dict()
        _merge(merged, values, "")
        return Config.from_dict(merged)

    @property
    def num_ranks(self) -> int:
        """topology.num_nodes x topology.gpus_per_node: the ranks an engine with it needs."""
        return self._native.num_ranks

    @property
    def policy(self) -> str:
        """policy.name."""
        return self._native.policy

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._native == other._native

    def __repr__(self) -> str:
        return f"keel.Config(policy={self.policy!r}, num_ranks={self.num_ranks})"


def _load_yaml(text: str) -> Any:
    """YAML with only true/false as booleans (YAML 1.2), as Keel's own reader sees it: values
    such as ``off`` stay the strings they are."""
    import re
    import yaml  # Debian: python3-yaml

    class Loader(yaml.SafeLoader):
        pass

    bool_tag = "tag:yaml.org,2002:bool"
    Loader.yaml_implicit_resolvers = {
        first: [(tag, regex) for tag, regex in resolvers if tag != bool_tag]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    # YAML 1.2's floats include an exponent without a dot ("1e-06", as to_yaml writes small
    # values), which PyYAML's YAML 1.1 resolver reads as a string. Added last, after the int
    # resolver, so that integers stay integers.
    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    return yaml.load(text, Loader=Loader)


def _merge(into: Dict[str, Any], values: Dict[str, Any], prefix: str) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, f"{prefix}{key}.")
        else:
            into[key] = value


def _check_config(config: Any) -> None:
    if config is not None and not isinstance(config, Config):
        raise InvalidArgumentError(
            f"config must be a keel.Config or None, got {type(config).__name__}")


def load_config(path: str) -> Config:
    """Reads and validates a YAML config file (same as ``Config.from_file``)."""
    return Config.from_file(path)


def policy_names() -> List[str]:
    """The placement policies: static, eplb, flexmoe, smartmoe, fastermoe, velb, lplb, swiftmoe,
    trtllm, keel, then any registered in C++ with keel::RegisterPolicy."""
    return list(_keel.policy_names())


def _tensor(flat: Sequence[Union[int, float]], shape: Tuple[int, ...], dtype: str) -> Any:
    """``flat`` as a torch tensor of ``shape`` when torch is installed, else nested lists."""
    try:
        import torch
    except ImportError:
        out: Any = list(flat)
        for size in reversed(shape[1:]):
            out = [out[i:i + size] for i in range(0, len(out), size)]
        return out
    return torch.tensor(list(flat), dtype=getattr(torch, dtype)).reshape(shape)


def _float64_bytes(values: Any, name: str) -> Tuple[bytes, Tuple[int, ...]]:
    """A tensor, array or nested list of numbers as float64 bytes and its shape."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and isinstance(values, torch.Tensor):
        if values.is_complex() or values.dtype == torch.bool:
            raise InvalidArgumentError(f"{name} has dtype {values.dtype}, expected real numbers")
        data = values.detach().to(device="cpu", dtype=torch.float64).contiguous()
        return data.numpy().tobytes(), tuple(data.shape)
    if hasattr(values, "__array__"):
        import numpy
        try:
            array = numpy.ascontiguousarray(values, dtype=numpy.float64)
        except (TypeError, ValueError, OverflowError) as error:
            raise InvalidArgumentError(
                f"{name} = {_checks.shown(values)} is not an array of numbers: {error}") from None
        return array.tobytes(), tuple(array.shape)
    import array as py_array
    rows = values if isinstance(values, (list, tuple)) else None
    if rows is None:
        raise InvalidArgumentError(
            f"{name} must be a tensor, an array or a list of rows, got {type(values).__name__}")
    if rows and all(isinstance(r, (list, tuple)) for r in rows):
        width = len(rows[0])
        for i, row in enumerate(rows):
            if len(row) != width:
                raise InvalidArgumentError(
                    f"{name}[{i}] has {len(row)} entries, {name}[0] has {width}")
        flat = [v for row in rows for v in row]
        shape: Tuple[int, ...] = (len(rows), width)
    else:
        flat, shape = list(rows), (len(rows),)
    try:
        return py_array.array("d", [float(v) for v in flat]).tobytes(), shape
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidArgumentError(f"{name} holds a value that is not a number: {error}") from None


def plan(policy: str, weight: Any, num_replicas: int, num_groups: int = 1, num_nodes: int = 1,
         num_gpus: int = 1, config: Optional[Config] = None) -> Tuple[Any, Any, Any]:
    """Plans a placement per layer, with the shapes of DeepSeek EPLB's ``rebalance_experts``.

    Args:
        policy: a name from :func:`policy_names`; ``"eplb"`` runs DeepSeek's algorithm as
            published, any other policy plans on ``num_nodes`` x ``num_gpus / num_nodes`` ranks
            with ``num_replicas / num_gpus`` slots each.
        weight: ``[num_layers, num_experts]`` load per expert (tensor, array or nested lists;
            any real dtype, read as float64), finite and >= 0. ``[num_experts]`` is one layer.
        num_replicas: physical slots per layer, >= num_experts, divisible by num_gpus.
        num_groups: expert groups (EPLB's hierarchical policy), dividing num_experts.
        num_nodes: nodes, dividing num_gpus.
        num_gpus: ranks.
        config: policy parameters and cost model (topology and slots come from the arguments).

    Returns:
        ``(phy2log, log2phy, logcnt)``: ``[num_layers, num_replicas]`` expert per slot (-1 for
        an empty slot), ``[num_layers, num_experts, max_copies]`` slots per expert padded with -1,
        and ``[num_layers, num_experts]`` copies per expert; int64 torch tensors when torch is
        installed (as EPLB returns), else nested lists.

    Raises:
        InvalidArgumentError: a bad argument, named with its value.
    """
    _checks.text("policy", policy)
    _check_config(config)
    data, shape = _float64_bytes(weight, "weight")
    if len(shape) == 1:
        shape = (1, shape[0])
    if len(shape) != 2:
        raise InvalidArgumentError(
            f"weight has shape {list(shape)}; expected [num_layers, num_experts]")
    counts = [_checks.integer(name, value, 1, 2 ** 31 - 1)
              for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups),
                                  ("num_nodes", num_nodes), ("num_gpus", num_gpus))]
    out = _keel.plan(policy, data, shape[0], shape[1], *counts,
                     config._native if config is not None else None)
    layers, experts = out["num_layers"], out["num_experts"]
    return (_tensor(out["phy2log"], (layers, out["num_replicas"]), "int64"),
            _tensor(out["log2phy"], (layers, experts, out["max_copies"]), "int64"),
            _tensor(out["logcnt"], (layers, experts), "int64"))


class Trace:
    """A routing trace in memory: per step and layer, tokens per expert, optionally per source
    rank (docs/traces.md). Read one with :func:`read_trace` or make one with
    :func:`synthetic_trace`."""

    def __init__(self, native: _keel.Trace) -> None:
        self._native = native

    description = property(lambda self: self._native.description)
    num_layers = property(lambda self: self._native.num_layers)
    num_experts = property(lambda self: self._native.num_experts)
    num_sources = property(lambda self: self._native.num_sources,
                           doc="source ranks of the traffic matrix; 0: per-expert counts only")
    num_steps = property(lambda self: self._native.num_steps)
    step_ids = property(lambda self: list(self._native.step_ids),
                        doc="[num_steps] the recorded step number of each step")

    def counts(self) -> Any:
        """float64 tokens, ``[num_steps, num_layers, num_sources, num_experts]`` (source-major
        traffic) or ``[num_steps, num_layers, num_experts]`` when the trace has no sources; a
        torch tensor (needs torch)."""
        import torch
        data = bytearray(self._native.counts_bytes())
        flat = torch.frombuffer(data, dtype=torch.float64) if data else torch.zeros(0,
                                                                                   dtype=torch.float64)
        shape = [self.num_steps, self.num_layers]
        if self.num_sources > 0:
            shape.append(self.num_sources)
        shape.append(self.num_experts)
        return flat.reshape(shape)

    def __repr__(self) -> str:
        return (f"keel.Trace({self.description!r}, steps={self.num_steps}, "
                f"layers={self.num_layers}, experts={self.num_experts}, "
                f"sources={self.num_sources})")


def read_trace(path: str, format: str = "auto") -> Trace:
    """Reads a trace: Keel's format or an importer's (keel, smartmoe, esft, olmoe, megatron;
    ``auto`` guesses from the path and content). :class:`NotFoundError` for a missing path."""
    return Trace(_keel.read_trace(_checks.path("path", path), _checks.text("format", format)))


def synthetic_trace(seed: int = 1, num_steps: int = 200, num_layers: int = 4,
                    num_experts: int = 32, num_sources: int = 8, tokens_per_source: int = 4096,
                    top_k: int = 2, zipf_exponent: float = 1.0) -> Trace:
    """The seeded synthetic trace of ``keel trace generate``: Zipf loads whose popularity drifts
    and bursts; the same arguments give the same trace on every machine."""
    int32 = 2 ** 31 - 1
    return Trace(_keel.synthetic_trace(
        _checks.integer("seed", seed, 0, 2 ** 64 - 1),
        _checks.integer("num_steps", num_steps, 1, int32),
        _checks.integer("num_layers", num_layers, 1, int32),
        _checks.integer("num_experts", num_experts, 1, int32),
        _checks.integer("num_sources", num_sources, 1, int32),
        _checks.integer("tokens_per_source", tokens_per_source, 1, int32),
        _checks.integer("top_k", top_k, 1, int32),
        _checks.number("zipf_exponent", zipf_exponent)))


def replay(trace: Union[Trace, str], config: Optional[Config] = None,
           policies: Optional[Sequence[str]] = None, oracle: bool = False,
           include_series: bool = True) -> Dict[str, Any]:
    """Replays a trace under placement policies, as ``keel replay`` does.

    Args:
        trace: a :class:`Trace`, a path (read with format ``auto``), or ``"synthetic"``.
        config: topology, slots, cost model and policy parameters; None fits one to the trace.
        policies: names from :func:`policy_names`; None replays all of them.
        oracle: plan each step from its own load (an upper bound) instead of estimates.
        include_series: add each policy's ``"series"``: per-step imbalance and simulated
            seconds.

    Returns:
        The report ``keel replay --report`` writes (docs/replay.md), as a dict: ``"policies"``
        maps each name to its imbalance, moved state, simulated step time and planner time.
    """
    if isinstance(trace, (str, os.PathLike)):
        trace = synthetic_trace() if trace == "synthetic" else read_trace(trace)
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(
            f"trace must be a keel.Trace, a path or 'synthetic', got {type(trace).__name__}")
    _check_config(config)
    names = _checks.strings("policies", policies) if policies is not None else []
    text = _keel.replay(trace._native, config._native if config is not None else None, names,
                        _checks.flag("oracle", oracle),
                        _checks.flag("include_series", include_series))
    return json.loads(text)


def condense_rows(rows: Any, bucket_begin: Any, threshold: float,
                  window: int = 32) -> Tuple[Any, Any]:
    """Which rows of one expert stand for others (Luffy's token condensation, docs/luffy.md).

    Args:
        rows: ``[num_rows, hidden]`` float32 CPU tensor, grouped in buckets (one per
            destination slot).
        bucket_begin: ``[num_buckets + 1]`` int32 or int64 CPU tensor; bucket ``b`` is rows
            ``[bucket_begin[b], bucket_begin[b + 1])``.
        threshold: in (0, 1]: rows are similar when identical or (below 1) when their cosine is
            at least this. 1.0 condenses exactly the repeated rows.
        window: rows before a row in its bucket that it is compared with (>= 1).

    Returns:
        ``(representative, kept)``: ``[num_rows]`` int32, the row sent in each row's place (itself
        for a row that is sent), and ``[num_buckets]`` int32, the rows each bucket sends.
    """
    import torch
    check_tensor("rows", rows, (torch.float32,), dims=2)
    check_tensor("bucket_begin", bucket_begin, (torch.int32, torch.int64), dims=1)
    data = rows.contiguous()
    begin = to_int32("bucket_begin", bucket_begin)
    if begin.numel() < 1:
        raise InvalidArgumentError("bucket_begin is empty: it needs num_buckets + 1 entries")
    threshold = _checks.number("threshold", threshold)
    window = _checks.integer("window", window, 1, 2 ** 31 - 1)
    representative = torch.empty(data.shape[0], dtype=torch.int32)
    kept = torch.empty(begin.numel() - 1, dtype=torch.int32)
    _keel.condense_rows(data.data_ptr(), data.shape[0], data.shape[1], begin.data_ptr(),
                        begin.numel() - 1, threshold, window,
                        representative.data_ptr(), kept.data_ptr())
    return representative, kept
