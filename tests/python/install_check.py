#!/usr/bin/python3
"""`cmake --install BUILD --prefix TMP` puts the Python package where STRATA_PYTHON_INSTALL_DIR
says (relative to the prefix), and /usr/bin/python3 imports it from there (not from the build
tree) and trains a step. Usage: install_check.py BUILD_DIR SITE_RELATIVE_DIR
"""
import os
import subprocess
import sys
import tempfile

CHECK = r"""
import os, sys, torch, strata
assert strata.__file__.startswith(os.environ["PREFIX"]), strata.__file__
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
opt = strata.torch.ZeroOptimizer(m, {"zero": {"stage": 2}})
opt.backward(m(torch.randn(4, 8)).square().mean())
assert opt.step().applied
print("installed strata", strata.__version__, "at", os.path.dirname(strata.__file__))
"""


def main():
    build, site = sys.argv[1], sys.argv[2]
    if os.path.isabs(site):
        print("SKIPPED: STRATA_PYTHON_INSTALL_DIR is absolute (%s): not installing there" % site)
        return 77
    with tempfile.TemporaryDirectory() as prefix:
        subprocess.run(["cmake", "--install", build, "--prefix", prefix], check=True, stdout=subprocess.DEVNULL)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PYTHONPATH=os.path.join(prefix, site), PREFIX=prefix)
        return subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=prefix).returncode


if __name__ == "__main__":
    sys.exit(main())
