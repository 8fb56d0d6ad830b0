#!/usr/bin/python3
"""A dead or stalled rank under torch.distributed (gloo): the other rank gets a strata exception
within runtime.collective_timeout_s, never a hang, and the optimizer then refuses with a message
that says how to recover (issue 13, points 3 and 7).

  dead_rank.py            the test: for MODE in kill, stall, launches 2 ranks the way torchrun
                          does (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK in the
                          environment) and checks rank 0's report.
  dead_rank.py worker MODE OUT   one rank (started by the test).

kill:  rank 1 SIGKILLs itself in the middle of step 3's backward (a stage-2 bucket's
       reduce-scatter is in flight); rank 0 must raise CommError or TimeoutError within the
       timeout.
stall: rank 1 stops taking part (sleeps) before step 3; rank 0 must raise TimeoutError after
       about the timeout (not before: a slow peer is not dead), naming the collective.
Then rank 0's next call must raise EngineFailedError saying "load_checkpoint".
alone: rank 0 calls opt.state_dict() (collective) alone before step 3, as HF Trainer saves the
       optimizer on the main process only, while rank 1 goes on into step 3's collectives: rank 0
       must raise UsageError naming the collective call (it once paired its gathers with rank 1's
       reduce-scatter, and gloo aborted both processes), rank 1 a strata error; no process aborts.
       Both name what the other rank does (issue 48, point 4: announced in the store, not found by
       a collective timeout).
eval_alone: stage 3, rank 0 evaluates (a forward under no_grad: gathers) alone before step 3, as
       nanoGPT's `if master_process: estimate_loss()`: the same, naming the forward (it once died
       in gloo, SIGABRT).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from verdict import verdict  # (this folder: the script's own, first on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 6.0
HANG_S = 60.0  # an error later than this counts as a hang (rank 0 is killed at 120 s)


def worker(mode, out):
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
    import gpt_model as G
    import strata

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = G.GPT(d_model=64, layers=2, heads=2, seq_len=16)
    cfg = {"zero": {"stage": 3 if mode == "eval_alone" else 2, "reduce_bucket_size": 4000},
           "runtime": {"collective_timeout_s": TIMEOUT_S}}
    opt = strata.torch.ZeroOptimizer(model, cfg)
    data = G.load_corpus()
    report = {"rank": rank, "backend": opt.backend, "world": opt.world}
    t0 = None
    try:
        for step in range(6):
            x, y = G.global_batch(data, step, 4, 16)
            x, y = x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2]
            if step == 3 and rank == 0 and mode == "alone":
                t0 = time.monotonic()
                opt.state_dict()  # the main process's save, alone
            if step == 3 and rank == 0 and mode == "eval_alone":
                t0 = time.monotonic()
                with torch.no_grad():
                    model(x, y)  # the main process's evaluation, alone
            if step == 3 and rank == 1 and mode not in ("alone", "eval_alone"):
                if mode == "stall":
                    time.sleep(5 * TIMEOUT_S)
                    os._exit(0)
                # Die once the first bucket of this backward has been handed in.
                n = [0]

                def die(grad):
                    n[0] += 1
                    if n[0] == 3:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return grad
                for p in model.parameters():
                    p.register_hook(die)
            t0 = time.monotonic()
            loss = model(x, y)
            opt.backward(loss)
            opt.step()
            report["steps_done"] = step + 1
    except Exception as e:  # noqa: BLE001 (the point: which exception, how fast)
        report.update(error=type(e).__name__, mro=[c.__name__ for c in type(e).__mro__],
                      message=str(e), seconds=time.monotonic() - t0)
        try:
            opt.step()
        except Exception as e2:  # noqa: BLE001
            report.update(second_error=type(e2).__name__, second_message=str(e2))
    with open(out, "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    if rank == 0 and mode in ("alone", "eval_alone"):  # the store lives here: until rank 1 read it
        other = out.replace(".rank0.", ".rank1.")
        for _ in range(1200):
            if os.path.exists(other):
                break
            time.sleep(0.05)
    os._exit(0)  # (no torch.distributed teardown with a dead peer)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(mode, tmp):
    """Two worker ranks in MODE, started the way torchrun does; their report paths and processes."""
    port = free_port()
    outs = [os.path.join(tmp, "%s.rank%d.json" % (mode, r)) for r in range(2)]
    procs = []
    for r in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "worker", mode, outs[r]], env=env))
    return outs, procs


def run(mode, tmp):
    outs, procs = spawn(mode, tmp)
    deadline = time.monotonic() + 120
    rc0 = None
    while time.monotonic() < deadline:
        rc0 = procs[0].poll()
        if rc0 is not None:
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if rc0 is None:
        return ["%s: rank 0 hung (killed after 120 s)" % mode]
    rep = json.load(open(outs[0]))
    print("%s: rank 0 report: %s" % (mode, json.dumps(rep, indent=1)))
    bad = []
    if rep.get("backend") != "c10d(gloo)":
        bad.append("%s: backend %s" % (mode, rep.get("backend")))
    if "error" not in rep:
        return bad + ["%s: rank 0 saw no error (%s steps done)" % (mode, rep.get("steps_done"))]
    if "StrataError" not in rep["mro"]:
        bad.append("%s: %s is not a strata.StrataError" % (mode, rep["error"]))
    if mode == "kill":
        if rep["error"] not in ("CommError", "TimeoutError"):
            bad.append("kill: %s, want CommError or TimeoutError" % rep["error"])
        if rep["seconds"] > HANG_S:
            bad.append("kill: the error came after %.1f s (timeout %.0f s): hung" % (rep["seconds"], TIMEOUT_S))
    else:
        if rep["error"] != "TimeoutError" or "TimeoutError" not in rep["mro"]:
            bad.append("stall: %s, want TimeoutError" % rep["error"])
        # At least the timeout (the peer did wait); the upper end is a hang guard, not a timing
        # check: a loaded machine may take long to raise it.
        if not (TIMEOUT_S - 0.5 <= rep["seconds"] <= HANG_S):
            bad.append("stall: the error came after %.1f s, want %.0f s or more (and no hang)"
                       % (rep["seconds"], TIMEOUT_S))
        if "collective_timeout_s" not in rep["message"]:
            bad.append("stall: the message does not name runtime.collective_timeout_s")
    if "load_checkpoint" not in rep["message"]:
        bad.append("%s: the first error does not say how to recover" % mode)
    if rep.get("second_error") != "EngineFailedError" or "load_checkpoint" not in rep.get("second_message", ""):
        bad.append("%s: the next call raised %s, want EngineFailedError naming load_checkpoint"
                   % (mode, rep.get("second_error")))
    return bad


def run_alone(tmp, mode="alone", call="state_dict()"):
    """Both ranks must report (no abort): rank 0 UsageError naming its call and what rank 1 does,
    rank 1 a strata error naming the call."""
    outs, procs = spawn(mode, tmp)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    bad = []
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            bad.append("%s: rank %d hung (killed after 120 s)" % (mode, r))
        p.wait()
        if p.returncode != 0:
            bad.append("%s: rank %d exited with %d (an abort is -6)" % (mode, r, p.returncode))
    reps = [json.load(open(o)) if os.path.exists(o) else {} for o in outs]
    print("%s: reports: %s" % (mode, json.dumps(reps, indent=1)))
    want0 = "rank 0 is in %s where rank 1 is in" % call
    if reps[0].get("error") != "UsageError" or want0 not in reps[0].get("message", ""):
        bad.append("%s: rank 0 raised %s, want UsageError saying '%s'"
                   % (mode, reps[0].get("error"), want0))
    if "StrataError" not in reps[1].get("mro", []) or call not in reps[1].get("message", ""):
        bad.append("%s: rank 1 raised %s, want a strata error naming %s"
                   % (mode, reps[1].get("error"), call))
    return bad


def main():
    import tempfile

    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
        return 0
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("kill", "stall"):
            bad += run(mode, tmp)
        bad += run_alone(tmp)
        bad += run_alone(tmp, "eval_alone", "a forward under no_grad (evaluation)")
    return verdict(bad)


if __name__ == "__main__":
    sys.exit(main())
