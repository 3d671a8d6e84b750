"""Keel's exceptions: one per status code of the library, each also a built-in exception where one
fits (a bad argument is a ValueError, a missing file a FileNotFoundError, a deadline a
TimeoutError), so callers can catch either. The message names the bad field and value."""

from __future__ import annotations


class KeelError(RuntimeError):
    """Base of every error the keel package raises. `code` is the library's status name."""

    code = "UNKNOWN"


class InvalidArgumentError(KeelError, ValueError):
    """A bad argument, option, config value or trace; the message names it and its value."""

    code = "INVALID_ARGUMENT"


class NotFoundError(KeelError, FileNotFoundError):
    """A file or name that does not exist."""

    code = "NOT_FOUND"


class IoError(KeelError, OSError):
    """Reading or writing failed."""

    code = "IO_ERROR"


class FailedPreconditionError(KeelError):
    """A call out of order (e.g. routing before every slot is registered)."""

    code = "FAILED_PRECONDITION"


class OutOfRangeError(KeelError, IndexError):
    code = "OUT_OF_RANGE"


class UnimplementedError(KeelError, NotImplementedError):
    """Something this build lacks (a backend compiled out, device memory)."""

    code = "UNIMPLEMENTED"


class InternalError(KeelError):
    """A bug or an unexpected failure inside Keel."""

    code = "INTERNAL"


class DeadlineExceededError(KeelError, TimeoutError):
    """A collective or transfer ran past its deadline: a peer stalled or died."""

    code = "DEADLINE_EXCEEDED"


class AbortedError(KeelError):
    """The job cannot go on after an earlier failure (a lost peer broke the collectives)."""

    code = "ABORTED"


_BY_CODE = {cls.code: cls for cls in (InvalidArgumentError, NotFoundError, IoError,
                                      FailedPreconditionError, OutOfRangeError,
                                      UnimplementedError, InternalError, DeadlineExceededError,
                                      AbortedError)}


def from_status(code: str, message: str) -> KeelError:
    """The exception for a failed status of the native library (called by keel._keel)."""
    return _BY_CODE.get(code, KeelError)(message)
