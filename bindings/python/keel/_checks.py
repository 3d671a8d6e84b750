"""Argument checks for the package's public calls: each names the argument and the value it got,
and raises keel.InvalidArgumentError, so that a wrong type never reaches the extension (where it
would be pybind11's TypeError, or a path cut at a NUL byte, or None read as the file "None")."""

from __future__ import annotations

import math
import operator
import os
import reprlib
from typing import Any, Iterable, List, Optional

from keel._errors import InvalidArgumentError

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist = 3, 60, 60, 6


def shown(value: Any) -> str:
    """``value`` for a message: its repr cut to about 60 characters, nesting to 3 levels (a
    container that holds itself, or is thousands of levels deep, still prints)."""
    try:
        return _SHOWN.repr(value)
    except Exception:  # noqa: BLE001 - a __repr__ that fails must not hide the real error
        return f"<{type(value).__name__} object>"


def integer(name: str, value: Any, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """``value`` as an int (Python, numpy or torch integers; not bool), in [low, high]."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
        raise InvalidArgumentError(f"{name} = {shown(value)} must be an integer") from None
    if (low is not None and number < low) or (high is not None and number > high):
        bounds = (f"in [{low}, {high}]" if low is not None and high is not None
                  else f">= {low}" if low is not None else f"<= {high}")
        raise InvalidArgumentError(f"{name} = {number} must be {bounds}")
    return number


def int32(name: str, value: Any) -> int:
    """``value`` as an int that fits the C int it is handed to; the library checks its range."""
    return integer(name, value, -2 ** 31, 2 ** 31 - 1)


def number(name: str, value: Any, low: Optional[float] = None,
           high: Optional[float] = None) -> float:
    """``value`` as a finite float (ints and floats of any library; not bool), in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(
            value, "__float__"):
        raise InvalidArgumentError(f"{name} = {shown(value)} must be a number")
    try:
        result = float(value)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        raise InvalidArgumentError(f"{name} = {shown(value)} must be a number") from None
    if not math.isfinite(result):
        raise InvalidArgumentError(f"{name} = {shown(value)} must be a finite number")
    if (low is not None and result < low) or (high is not None and result > high):
        bounds = (f"in [{low:g}, {high:g}]" if low is not None and high is not None
                  else f">= {low:g}" if low is not None else f"<= {high:g}")
        raise InvalidArgumentError(f"{name} = {result:g} must be {bounds}")
    return result


def flag(name: str, value: Any) -> bool:
    """``value`` as a bool: True or False only (a string such as "false" is refused)."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} = {shown(value)} must be True or False")
    return value


def text(name: str, value: Any, choices: Optional[Iterable[str]] = None) -> str:
    """``value`` as a str without NUL bytes (which C would read as its end) that UTF-8 can
    encode, one of ``choices`` when given."""
    if not isinstance(value, str):
        raise InvalidArgumentError(
            f"{name} must be a str, got {type(value).__name__} {shown(value)}")
    if "\0" in value:
        raise InvalidArgumentError(f"{name} = {shown(value)} contains a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate, e.g. from undecodable bytes
        raise InvalidArgumentError(
            f"{name} = {shown(value)} is not valid Unicode text: {error.reason} at index "
            f"{error.start}") from None
    if choices is not None:
        allowed: List[str] = list(choices)
        if value not in allowed:
            raise InvalidArgumentError(
                f"{name} = {shown(value)} is not one of {', '.join(allowed)}")
    return value


def path(name: str, value: Any, empty_ok: bool = False) -> str:
    """``value`` (a str or os.PathLike) as a path without NUL bytes; empty only with
    ``empty_ok`` (for a call whose own check names what an empty path would do)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes) or not isinstance(value, str):
        raise InvalidArgumentError(
            f"{name} must be a path (str or os.PathLike), got {type(value).__name__} "
            f"{shown(value)}")
    if not value and not empty_ok:
        raise InvalidArgumentError(f"{name} is empty: name a file or folder")
    return text(name, value)


def strings(name: str, values: Any) -> List[str]:
    """A list or tuple of str (not one str, which would be read letter by letter)."""
    if isinstance(values, str) or not isinstance(values, (list, tuple)):
        raise InvalidArgumentError(
            f"{name} must be a list of str, got {type(values).__name__} {shown(values)}")
    return [text(f"{name}[{i}]", v) for i, v in enumerate(values)]
