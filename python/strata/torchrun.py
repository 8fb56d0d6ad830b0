"""``python3 -m strata.torchrun ...``: torchrun (torch.distributed.run), with one fix for
Debian 12's torch 1.13 on Python 3.11.

There, plain ``torchrun`` fails before starting any worker with ``AttributeError: 'NoneType'
object has no attribute 'get'``: its ``Std.from_str("0")`` (the default of ``--redirects`` and
``--tee``) finds no member, because Python 3.11 no longer iterates the zero-valued flag
``Std.NONE``. This module maps that ``None`` back to ``Std.NONE`` and then runs torchrun's own
``main()`` with the same arguments; where torchrun works, it changes nothing.
"""
import sys


def _patch():
    from torch.distributed.elastic.multiprocessing import api

    if api.Std.from_str("0") is not None:
        return
    orig = api.Std.from_str.__func__

    def from_str(cls, vm):
        r = orig(cls, vm)
        if r is None:
            return api.Std.NONE
        if isinstance(r, dict):
            return {k: (api.Std.NONE if v is None else v) for k, v in r.items()}
        return r

    api.Std.from_str = classmethod(from_str)


def main(argv=None):
    _patch()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
