#!/usr/bin/python3
"""examples/hf_trainer.py as a test (issue 47, point 3): transformers' Trainer with
optimizers=(ZeroOptimizer, scheduler) against the same Trainer with torch.optim.AdamW, loss within
1e-4 at every micro-batch; on the GPU where torch sees one, else on the CPU. SKIPPED (exit 77, by
name) where transformers does not import (Debian 12 does not package it).

    PYTHONPATH=build/python python3 tests/python/hf_trainer_check.py [--device cpu|cuda]
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "hf_trainer.py")


def main():
    try:
        import transformers
    except ImportError as e:
        print("SKIPPED: hf_trainer_check: transformers does not import (%s)" % e, flush=True)
        return 77
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if len(sys.argv) == 3 and sys.argv[1] == "--device":
        device = sys.argv[2]
    print("hf_trainer_check: transformers %s, torch %s, on %s"
          % (transformers.__version__, torch.__version__, device), flush=True)
    cmd = [sys.executable, EXAMPLE, "--device", device, "--steps", "12"]
    rc = subprocess.call(cmd, timeout=600)
    print("hf_trainer_check: %s (rc %d)" % ("PASS" if rc == 0 else "FAIL", rc), flush=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
