"""Test-only: pins each Python test process to CPUs, as tests/test_main.cpp pins the C++ tests.

Python imports `usercustomize` at start-up from sys.path; tests/python/CMakeLists.txt puts this
folder on the tests' PYTHONPATH (never on a user's). Threads that hand work to each other (the
engine's movers and streams, gloo's) then wake on their own CPU instead of waking the other, which
on a virtual machine costs an exit to the hypervisor each time.

- A process CTest gave one CPU (RESOURCE_GROUPS "cpus:1", ctest --resource-spec-file, as
  scripts/test.sh runs it) runs on that CPU: the id-th of those it may run on; its children
  inherit it.
- A rank of a multi-process test (torchrun's LOCAL_RANK, Open MPI's OMPI_COMM_WORLD_LOCAL_RANK)
  started with STRATA_TEST_PIN_RANKS=1 runs on CPU (rank mod CPUs) of those it may run on: the
  ranks spread over the CPUs, each rank's threads together.
Anything else (the script run by hand, a launcher process) is left as it is.
"""
import os
import sys


def _pin(index, why):
    allowed = sorted(os.sched_getaffinity(0))
    cpu = allowed[index % len(allowed)]
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as e:
        print("usercustomize: cannot pin to CPU %d (%s): %s" % (cpu, why, e), file=sys.stderr)


def _main():
    spec = os.environ.get("CTEST_RESOURCE_GROUP_0_CPUS")  # "id:1,slots:1"
    rank = os.environ.get("LOCAL_RANK") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
    if spec:
        try:
            cpu_id = int(spec.split(",")[0].split(":")[1])
        except (IndexError, ValueError):
            print("usercustomize: CTEST_RESOURCE_GROUP_0_CPUS=%r is not id:N; not pinned" % spec,
                  file=sys.stderr)
            return
        _pin(cpu_id, "CTest's cpus resource")
    elif rank is not None and os.environ.get("STRATA_TEST_PIN_RANKS") == "1":
        _pin(int(rank), "local rank %s" % rank)


_main()
