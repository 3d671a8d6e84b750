"""What the keel.integrations tests share: importing a module while package metadata reports
another version of its trainer (or none), which the module must refuse by name."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from typing import Any, Sequence, Tuple

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
