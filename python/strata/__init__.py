"""strata: ZeRO training state in GPU, pinned host and NVMe tiers, for PyTorch.

    import strata
    opt = strata.torch.ZeroOptimizer(model, config="zero2-nvme.yaml")
    for x, y in data:
        loss = loss_fn(model(x), y)
        opt.backward(loss)
        result = opt.step()

See docs/python.md. Errors are the classes of :mod:`strata.errors`, re-exported here.
"""
import ctypes as _ctypes
import os as _os


def _preload_mpi():
    # Under mpirun, Open MPI's components (dlopen'ed plug-ins) need libmpi's symbols global; a
    # Python extension is loaded RTLD_LOCAL, so load libmpi globally first (what mpi4py does).
    if not any(v in _os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        return
    for name in ("libmpi.so.40", "libmpi.so.12", "libmpi.so"):
        try:
            _ctypes.CDLL(name, mode=_ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


_preload_mpi()

import torch as _torch  # noqa: E402,F401  (registers c10d's types before the extension uses them)

from . import _strata  # noqa: E402
from .errors import (  # noqa: E402,F401
    BudgetError,
    CancelledError,
    ChecksumError,
    CommError,
    ConfigError,
    DeviceError,
    EngineFailedError,
    InternalError,
    InvalidArgumentError,
    IoError,
    NumericError,
    OutOfMemoryError,
    ParameterTypeError,
    StrataError,
    TimeoutError,
    UnsupportedError,
    UsageError,
)
from .config import load_config  # noqa: E402,F401
from ._cleanup import install_signal_cleanup, remove_swap  # noqa: E402,F401

__version__ = _strata.__version__


def set_log_level(level):
    """strata's log level: "debug" | "info" | "warn" | "error" | "off" (stderr; default: info, or
    $STRATA_LOG_LEVEL)."""
    _strata.set_log_level(level)


from . import torch  # noqa: E402,F401  (strata.torch.ZeroOptimizer)
from . import safetensors  # noqa: E402,F401  (strata.safetensors.load_file, no import of its own)
