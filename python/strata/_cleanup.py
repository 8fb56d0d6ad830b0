"""Swap removal when a Python training process is ended by SIGTERM, SIGINT or SIGHUP.

strata's swap files (gigabytes each) are registered, while they exist, with the C++ cleanup
registry (include/strata/cleanup.hpp); the `strata` command line removes them from its signal
handlers. A Python process has its own handlers, so the package installs these (once, when the
first ZeroOptimizer is made, or by :func:`install_signal_cleanup`), chained to whatever was there:

- the previous handler is a Python callable (the user's, torch's, or Python's default SIGINT
  handler that raises KeyboardInterrupt): it is called; if it raises (KeyboardInterrupt,
  SystemExit, anything) the swap is removed and the exception goes on; if it returns (a handler
  that only sets a "stop after this step" flag), nothing is removed: the program goes on and its
  engines remove their swap when they are closed;
- the default action (SIG_DFL): the swap is removed, then the signal is raised again with the
  default action (the process ends with the signal, status 128 + N in a shell);
- ignored (SIG_IGN, e.g. under nohup) or a handler installed outside Python (signal.getsignal()
  is None): left alone, not replaced.

A handler installed after ours replaces it (Python keeps one handler per signal): call
install_signal_cleanup() again after installing yours and it chains to yours. Handlers can be set
only from the main thread; from another thread nothing is installed (a warning says so).
"""
import os
import signal
import threading
import warnings

from . import _strata

_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n))
_previous = {}  # signal number -> the handler ours chains to
_lock = threading.Lock()


def remove_swap():
    """Removes every swap file and swap directory this process's engines have now (the files
    registered for removal on a signal). For a process that is about to end: an engine whose swap
    was removed must not be used for training afterwards. Returns how many entries were removed."""
    return _strata._run_signal_cleanup()


def _handler(signum, frame):
    prev = _previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        try:
            prev(signum, frame)
        except BaseException:
            remove_swap()
            raise
        return
    remove_swap()
    # The default action, as if no handler had been installed.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_signal_cleanup():
    """Installs the chained handlers described in this module's docstring (idempotent). Returns
    the signals whose handler is now ours."""
    if threading.current_thread() is not threading.main_thread():
        warnings.warn("strata: signal handlers can only be installed from the main thread; swap "
                      "files are not removed on SIGTERM/SIGINT/SIGHUP in this process (call "
                      "strata.install_signal_cleanup() from the main thread)", RuntimeWarning,
                      stacklevel=2)
        return []
    ours = []
    with _lock:
        for sig in _SIGNALS:
            cur = signal.getsignal(sig)
            if cur is _handler:
                ours.append(sig)
                continue
            if cur is None or cur == signal.SIG_IGN:
                continue
            _previous[sig] = cur
            signal.signal(sig, _handler)
            ours.append(sig)
    return ours
