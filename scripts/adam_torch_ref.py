#!/usr/bin/python3
"""Reference runs of torch.optim.Adam / AdamW for strata's optimizer tests and benchmark.

Run with Debian's /usr/bin/python3 (python3-torch 1.13).

  adam_torch_ref.py check DIR     DIR/cases.txt lists cases, one per line:
        name type lr beta1 beta2 eps weight_decay n steps grad_dtype grad_scale foreach [ranks]
      and DIR/<name>.init (n float32), DIR/<name>.grads (steps*ranks*n of grad_dtype, raw: for
      each step the ranks' gradients in rank order); with ranks > 1 the gradient of a step is the
      ranks' sum, added in rank order, divided by ranks (data-parallel averaging: DDP's
      all-reduce then division by the world size), then times grad_scale;
      writes DIR/<name>.torch (n float32: the master after the steps) and DIR/<name>.exp_avg
      (n float32: the first moment after the steps).
      Also: DIR/convert.f32 (float32) -> DIR/convert.bf16, DIR/convert.fp16 (torch's casts).
  adam_torch_ref.py bench N THREADS ROUNDS   AdamW(foreach=True) on one N-element parameter;
      prints one line: params_per_second=<median of ROUNDS steps, after a warm-up step>.
"""
import os
import sys
import time

import torch


def load(path, dtype, count):
    data = open(path, "rb").read()
    t = torch.frombuffer(bytearray(data), dtype=dtype)
    assert t.numel() == count, (path, t.numel(), count)
    return t


def check(d):
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for line in open(os.path.join(d, "cases.txt")):
        f = line.split()
        if not f:
            continue
        name, typ = f[0], f[1]
        lr, b1, b2, eps, wd = map(float, f[2:7])
        n, steps = int(f[7]), int(f[8])
        gdt, scale, foreach = dtypes[f[9]], float(f[10]), f[11] == "1"
        ranks = int(f[12]) if len(f) > 12 else 1
        p = torch.nn.Parameter(load(os.path.join(d, name + ".init"), torch.float32, n).clone())
        grads = load(os.path.join(d, name + ".grads"), gdt, n * steps * ranks).view(steps, ranks, n)
        cls = torch.optim.Adam if typ == "adam" else torch.optim.AdamW
        opt = cls([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=foreach)
        for s in range(steps):
            # Mixed precision as the engine does it: upcast to FP32, average over the ranks
            # (sum in rank order, then divide by the world size), then unscale/clip.
            g = grads[s][0].float().clone()
            for r in range(1, ranks):
                g += grads[s][r].float()
            if ranks > 1:
                g = g / ranks
            p.grad = g * scale
            opt.step()
        p.detach().numpy().tofile(os.path.join(d, name + ".torch"))
        opt.state[p]["exp_avg"].numpy().tofile(os.path.join(d, name + ".exp_avg"))
    conv = os.path.join(d, "convert.f32")
    if os.path.exists(conv):
        x = torch.frombuffer(bytearray(open(conv, "rb").read()), dtype=torch.float32)
        x.to(torch.bfloat16).view(torch.int16).numpy().tofile(os.path.join(d, "convert.bf16"))
        x.to(torch.float16).view(torch.int16).numpy().tofile(os.path.join(d, "convert.fp16"))


def bench(n, threads, rounds):
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 0.01
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, foreach=True)
    opt.step()  # creates the state
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    print("params_per_second=%.6g seconds=%.6g best_seconds=%.6g" % (n / med, med, times[0]))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "check":
        check(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "bench":
        bench(int(float(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.stderr.write(__doc__)
        sys.exit(2)
