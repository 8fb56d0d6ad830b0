"""strata's errors as Python exceptions.

Every failure inside strata is a C++ ``strata::Error`` with an ``ErrorCode`` (docs/errors.md);
the extension turns it into the matching class below, carrying strata's message unchanged. Each
class derives from :class:`StrataError` *and* from the built-in exception a Python user would
expect (``ValueError`` for bad input, ``OSError`` for I/O, ``TimeoutError`` for a collective past
its deadline, ...), so ``except ValueError`` and ``except strata.StrataError`` both work.

Every instance has ``.code`` (strata's error code name, e.g. ``"config"``, ``"timeout"``).
:class:`ConfigError` also has ``file``, ``line``, ``column`` (1-based, 0 when unknown),
``key_path`` and ``detail``; :class:`IoError` has ``op``, ``path``, ``offset``, ``length``,
``errno`` and ``context``.
"""
import builtins


class StrataError(Exception):
    """Base class of every error strata raises."""

    code = "unknown"


class InvalidArgumentError(StrataError, ValueError):
    """Bad input from the caller: arguments, paths, options (strata's kInvalidArgument)."""

    code = "invalid argument"


class ConfigError(StrataError, ValueError):
    """A bad configuration. ``str(e)`` is ``FILE:LINE:COL: KEY.PATH: message``."""

    code = "config"
    file = ""
    line = 0
    column = 0
    key_path = ""
    detail = ""


class IoError(StrataError, OSError):
    """A failed read, write, open, fallocate... ``str(e)`` names the path, offset, length and errno."""

    code = "io"
    op = ""
    path = ""
    offset = 0
    length = 0
    context = ""


class ChecksumError(StrataError, OSError):
    """Data read back (NVMe swap, checkpoint) does not match what was written."""

    code = "checksum"


class OutOfMemoryError(StrataError, MemoryError):
    """An allocation or a pinned/device memory budget could not be met."""

    code = "out of memory"


class BudgetError(OutOfMemoryError):
    """A tier's configured budget (tiers.*.budget) would be exceeded."""

    code = "budget"


class TimeoutError(StrataError, builtins.TimeoutError):
    """A wait ran past its deadline: a collective (runtime.collective_timeout_s) whose peer is
    dead, stalled or out of step, a pinned buffer, an I/O completion."""

    code = "timeout"


class CommError(StrataError, RuntimeError):
    """A collective or its bootstrap failed (a lost peer, an MPI / gloo / NCCL error)."""

    code = "comm"


class DeviceError(StrataError, RuntimeError):
    """A CUDA (or emulated device) call failed."""

    code = "device"


class UnsupportedError(StrataError, NotImplementedError):
    """A feature this build or this machine does not have."""

    code = "unsupported"


class NumericError(StrataError, ArithmeticError):
    """inf/NaN or another numeric failure the caller must handle."""

    code = "numeric"


class CancelledError(StrataError, RuntimeError):
    """The operation was cancelled (shut down with it in flight)."""

    code = "cancelled"


class InternalError(StrataError, RuntimeError):
    """A broken invariant inside strata: a bug; please report it."""

    code = "internal"


class ParameterTypeError(InvalidArgumentError, TypeError):
    """A model parameter strata cannot hold: not floating point, or not the dtype precision.params
    names."""


class UsageError(StrataError, RuntimeError):
    """The training loop called the optimizer out of order (e.g. step() before backward())."""

    code = "invalid argument"


class EngineFailedError(StrataError, RuntimeError):
    """The optimizer cannot continue: an earlier step failed part-way (a collective, NVMe I/O,
    a checksum), so the optimizer state may mix two steps. The message says how to recover."""

    code = "io"


_BY_CODE = {
    "invalid argument": InvalidArgumentError,
    "config": ConfigError,
    "io": IoError,
    "checksum": ChecksumError,
    "out of memory": OutOfMemoryError,
    "budget": BudgetError,
    "timeout": TimeoutError,
    "device": DeviceError,
    "comm": CommError,
    "unsupported": UnsupportedError,
    "numeric": NumericError,
    "cancelled": CancelledError,
    "internal": InternalError,
}


def _from_strata(code, message, attrs):
    """Called by the extension: the exception instance for a C++ strata::Error."""
    cls = _BY_CODE.get(code, StrataError)
    exc = cls(message)
    exc.code = code
    for k, v in attrs.items():
        setattr(exc, k, v)
    return exc


def with_recovery(exc, hint):
    """A copy of strata exception `exc` of the same class whose message ends with `hint`."""
    new = type(exc)("%s\n%s" % (exc, hint))
    for k, v in vars(exc).items():
        if k not in ("args",):
            try:
                setattr(new, k, v)
            except AttributeError:
                pass
    return new
