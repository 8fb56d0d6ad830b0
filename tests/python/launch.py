#!/usr/bin/python3
"""Runs a Python script on N ranks for strata's CTest tests, the way a user would:

  launch.py --launcher torchrun --np 2 SCRIPT ARGS...   python3 -m strata.torchrun, one node, a c10d
                                                         rendezvous on a free port
  launch.py --launcher mpirun --np 4 SCRIPT ARGS...     $STRATA_MPIEXEC --allow-run-as-root --oversubscribe -np 4
  launch.py --launcher none SCRIPT ARGS...              one plain process

--fresh-dir DIR empties DIR first. Then, with --then CMD..., runs CMD (e.g. the result check) if the launch succeeded. Exit code: the
launch's (or CMD's); 77 (CTest: skipped) when the launcher is missing. --timeout bounds the launch
(the whole process group is killed after it: a hang fails instead of blocking CI).
"""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid

PY = "/usr/bin/python3"


def free_port():
    """A TCP port nobody listens on now (the kernel's pick; released for torchrun to bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--launcher", choices=["torchrun", "mpirun", "none"], required=True)
    ap.add_argument("--np", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=500)
    ap.add_argument("--fresh-dir", help="a directory to empty (create) before the launch")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    then = None
    if "--then" in a.args:
        i = a.args.index("--then")
        a.args, then = a.args[:i], a.args[i + 1:]
    if a.fresh_dir:
        shutil.rmtree(a.fresh_dir, ignore_errors=True)
        os.makedirs(a.fresh_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if a.launcher == "torchrun":
        # Not --standalone: torch 1.13 puts its rendezvous on port 29400, so two suites on one
        # machine would collide (or merge their jobs). A free port and a job id of our own.
        cmd = [PY, "-m", "strata.torchrun", "--nnodes", "1", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", "localhost:%d" % free_port(), "--rdzv_id", uuid.uuid4().hex,
               "--nproc_per_node", str(a.np), a.script]
    elif a.launcher == "mpirun":
        mpiexec = os.environ.get("STRATA_MPIEXEC") or shutil.which("mpiexec")
        if not mpiexec:
            print("SKIPPED: no mpiexec")
            return 77
        # Loopback only, no ptrace-based single copy (containers forbid it).
        cmd = [mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", str(a.np),
               "--mca", "btl", "self,vader,tcp", "--mca", "btl_vader_single_copy_mechanism", "none",
               "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "OPENBLAS_NUM_THREADS", "-x", "PYTHONUNBUFFERED",
               PY, a.script]
    else:
        cmd = [PY, a.script]
    cmd += a.args
    print("+", " ".join(cmd), flush=True)
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = p.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        print("FAIL: the launch ran past %.0f s and was killed" % a.timeout)
        return 1
    if rc != 0:
        print("FAIL: the launch exited with %d" % rc)
        return rc if rc > 0 else 1
    if then:
        print("+", " ".join(then), flush=True)
        return subprocess.call(then, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
