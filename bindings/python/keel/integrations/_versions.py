"""The version check each keel.integrations module makes when it is imported: the trainer's
installed release must lie in the range the module was tested with, or the import fails with
:class:`keel.UnimplementedError` naming the installed version and the range."""

from __future__ import annotations

import importlib.metadata
import re
from typing import Optional, Tuple

from keel._errors import UnimplementedError


def release(distribution: str, version: str) -> Tuple[int, int, int]:
    """``"0.19.8"``, ``"0.3.0.dev20261101"``, ``"0.3"``, ``"0.19.8+cpu"`` -> (major, minor,
    patch)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise UnimplementedError(f"{distribution} version {version!r} is not a release number")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def require(module: str, distribution: str, supported: Tuple[str, str], replaced: str,
            version: Optional[str] = None) -> str:
    """Returns ``version`` (default: the installed ``distribution``'s, from its package
    metadata) when it is at least ``supported[0]`` and below ``supported[1]`` (a pre-release of
    the upper bound is outside); raises :class:`keel.UnimplementedError` naming ``module``, the
    version and the range otherwise. ``replaced`` names the trainer's interface that ``module``
    replaces, which another release may have changed."""
    low, high = supported
    if version is None:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            raise UnimplementedError(
                f"{module} needs {distribution}, which is not installed (supported: >= {low}, "
                f"< {high})") from None
    if not release(distribution, low) <= release(distribution, version) < release(
            distribution, high):
        raise UnimplementedError(
            f"{module} supports {distribution} >= {low}, < {high}; {distribution} {version} is "
            f"installed. Its {replaced} is what this module replaces, so another release needs "
            f"a Keel tested with it (docs/integrations/README.md)")
    return version
