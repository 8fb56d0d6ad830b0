#!/usr/bin/python3
"""examples/train_gpt.py end to end (a smaller GPT, 6 steps of two micro-batches, --accumulate 2):
the optimizer state on NVMe (examples/zero2-nvme.yaml, swap in a temp dir), the per-step line
(loss, tokens/s, the time split), the losses beside torch.optim.AdamW's on the same global batches
(equal but for rounding) and the plot, and --save-every / --resume: a run stopped after step 4 and
resumed from its checkpoint has the same losses, bit for bit, as one that did not stop.
"""
import json
import os
import subprocess
import sys
import tempfile

from verdict import verdict  # (this folder: the script's own, first on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "train_gpt.py")
CONFIG = os.path.join(HERE, "..", "..", "examples", "zero2-nvme.yaml")


def run(tmp, *args):
    cmd = [sys.executable, EXAMPLE, "--config", CONFIG, "--set", "tiers.nvme.paths=[%s/nvme]" % tmp,
           "--steps", "6", "--d-model", "64", "--layers", "2", "--heads", "2", "--seq-len", "32", "--rows", "2",
           "--threads", "1", "--accumulate", "2"] + list(args)
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(p.stdout, p.stderr, flush=True)
    if p.returncode != 0:
        raise SystemExit("FAIL: train_gpt.py exited with %d" % p.returncode)
    return p.stdout


def main():
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(tmp + "/nvme")
        out = run(tmp, "--compare-torch", "--plot", tmp + "/loss.png", "--log-json", tmp + "/a.json")
        for word in ("optimizer state on nvme", "tok/s", "backward", "reduce", "optimizer", "(exposed ",
                     "transfers", "(torch "):
            if word not in out:
                bad.append("the output lacks %r" % word)
        for r in json.load(open(tmp + "/a.json")):
            # Two micro-batches a step, state on NVMe: the loss is torch AdamW's on the same global
            # batch (one backward) but for the rounding of the gradient's summation order.
            if abs(r["loss"] - r["torch_loss"]) > 1e-5 * max(1.0, abs(r["torch_loss"])):
                bad.append("step %d: loss %r, torch AdamW's %r" % (r["step"], r["loss"], r["torch_loss"]))
            # The optimizer time the backward did not hide.
            if not 0 <= r["exposed_s"] <= r["step_s"]:
                bad.append("step %d: exposed_s %r outside [0, step_s %r]" % (r["step"], r["exposed_s"],
                                                                            r["step_s"]))
        with open(tmp + "/loss.png", "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                bad.append("loss.png is not a PNG")
        run(tmp, "--save-every", "2", "--stop-after", "4", "--checkpoint-dir", tmp + "/ckpt",
            "--log-json", tmp + "/b1.json")
        out = run(tmp, "--resume", "--checkpoint-dir", tmp + "/ckpt", "--log-json", tmp + "/b2.json")
        if "resumed from" not in out or "at step 4" not in out:
            bad.append("no 'resumed ... at step 4' line")
        a = json.load(open(tmp + "/a.json"))
        b = json.load(open(tmp + "/b1.json")) + json.load(open(tmp + "/b2.json"))
        la = [(r["step"], r["loss"]) for r in a]
        lb = [(r["step"], r["loss"]) for r in b]
        if la != lb:
            bad.append("resumed losses differ: %s vs %s" % (la, lb))
        if os.listdir(tmp + "/nvme"):
            bad.append("swap left behind: %s" % os.listdir(tmp + "/nvme"))
    return verdict(bad)


if __name__ == "__main__":
    sys.exit(main())
