#!/usr/bin/python3
"""A Python training loop ended by a signal leaves no swap behind (issue 25, point 5).

Each case runs a real training loop (strata.torch.ZeroOptimizer, optimizer state on the NVMe tier)
in a subprocess, waits until it has trained a step (and so holds its swap directory), sends the
signal, and checks how the process ended and that the swap path is empty:
  - SIGTERM and SIGHUP, no handler of the user's: the process ends by that signal (default
    action, re-raised);
  - SIGINT: Python's KeyboardInterrupt goes on (the loop's `finally` runs), exit by SIGINT;
  - SIGTERM with the user's handler installed first (it raises SystemExit(7)): the user's handler
    runs (chained, not replaced), the swap is removed, exit status 7;
  - SIGHUP with the user's handler that only sets a flag: nothing is removed behind the loop's
    back; the loop sees the flag, closes the optimizer, exits 0 (close() removes the swap).
Run with /usr/bin/python3, PYTHONPATH=<build>/python.
"""
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import unittest

CHILD = textwrap.dedent(r"""
    import os, signal, sys, time
    import torch
    import strata
    mode, swap = sys.argv[1], sys.argv[2]
    flag = []
    if mode == "user_exit":
        def user(signum, frame):
            print("USER-HANDLER", signum, flush=True)
            raise SystemExit(7)
        signal.signal(signal.SIGTERM, user)
    elif mode == "user_flag":
        signal.signal(signal.SIGHUP, lambda s, f: flag.append(s))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    cfg = {"zero": {"stage": 2}, "runtime": {"cpu_threads": 1},
           "offload": {"optimizer": {"tier": "nvme"}},
           "tiers": {"nvme": {"paths": [swap], "direct_io": "off"}, "host": {"buffer_size": "1MiB"}}}
    opt = strata.torch.ZeroOptimizer(model, cfg)
    x, y = torch.randn(16, 64), torch.randn(16, 8)
    # With the user's SystemExit handler, SIGTERM waits (blocked) while backward and step run: a
    # SystemExit raised inside torch 1.13's backward can leave an autograd node in a thread-local
    # that is freed at exit after the interpreter is finalised, and the process then hangs in
    # PyEval_AcquireThread (seen once in CI: docs/python.md, "Signals"). Not strata's to fix.
    guard = {signal.SIGTERM} if mode == "user_exit" else set()
    step = 0
    try:
        while not flag:
            signal.pthread_sigmask(signal.SIG_BLOCK, guard)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.backward(loss)
            opt.step()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, guard)
            step += 1
            if step == 1:
                print("READY", os.listdir(swap), flush=True)
            time.sleep(0.01)
    finally:
        print("FINALLY", flush=True)
    print("FLAG-SEEN", flag, flush=True)
    opt.close()
    print("CLOSED", os.listdir(swap), flush=True)
""")


class SignalCleanup(unittest.TestCase):
    def run_case(self, mode, sig):
        with tempfile.TemporaryDirectory() as d:
            swap = os.path.join(d, "swap")
            os.makedirs(swap)
            script = os.path.join(d, "child.py")
            with open(script, "w") as f:
                f.write(CHILD)
            p = subprocess.Popen([sys.executable, script, mode, swap], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            line = p.stdout.readline()
            if not line.startswith("READY"):
                p.kill()
                out, err = p.communicate()
                self.fail("the child did not train: %r %r %r" % (line, out, err))
            self.assertNotEqual(os.listdir(swap), [], "the loop holds swap while it trains")
            p.send_signal(sig)
            out, err = p.communicate(timeout=120)
            left = [os.path.join(r, n) for r, ds, fs in os.walk(swap) for n in ds + fs]
            self.assertEqual(left, [], "swap left behind (%s, %s):\n%s%s" % (mode, sig, out, err))
            return p.returncode, out, err

    def test_sigterm_default_action(self):
        rc, out, err = self.run_case("plain", signal.SIGTERM)
        self.assertEqual(rc, -signal.SIGTERM, out + err)

    def test_sighup_default_action(self):
        rc, out, err = self.run_case("plain", signal.SIGHUP)
        self.assertEqual(rc, -signal.SIGHUP, out + err)

    def test_sigint_keyboard_interrupt(self):
        rc, out, err = self.run_case("plain", signal.SIGINT)
        self.assertIn("FINALLY", out)
        self.assertIn("KeyboardInterrupt", err)
        self.assertIn(rc, (-signal.SIGINT, 1), out + err)

    def test_sigterm_chains_to_the_users_handler(self):
        rc, out, err = self.run_case("user_exit", signal.SIGTERM)
        self.assertIn("USER-HANDLER %d" % signal.SIGTERM, out)
        self.assertEqual(rc, 7, out + err)

    def test_sighup_handled_by_the_user_leaves_the_loop_running(self):
        rc, out, err = self.run_case("user_flag", signal.SIGHUP)
        self.assertIn("FLAG-SEEN", out)
        self.assertIn("CLOSED []", out)
        self.assertEqual(rc, 0, out + err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
