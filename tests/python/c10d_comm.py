#!/usr/bin/python3
"""The c10d Communicator (python/src/c10d_communicator.cpp) under torchrun with gloo: every
collective, named cases (dtype x counts, uneven and with zeros), checked bitwise against what
strata's host backends define: a rank-ordered sum from rank 0's value, FP16/BF16 summed in FP32
and rounded once; several collectives in flight at once; byte accounting; a broadcast from every
root. Each rank derives every rank's data from (seed, rank), so it knows the exact answer.
Writes nothing; exits 1 on the first failure (naming the case).
"""
import sys

import torch
import torch.distributed as dist

import strata
from strata import _strata

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ES = {"fp32": 4, "bf16": 2, "fp16": 2}


def data(seed, rank, n, dt):
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    # Values of mixed magnitude, so that the order of the additions shows in the low bits.
    x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-3, 4, (n,), generator=g).float())
    return x.to(DT[dt])


def ordered_sum(parts, dt):
    acc = parts[0].float().clone()
    for p in parts[1:]:
        acc += p.float()
    return acc.to(DT[dt])


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.view(torch.int16 if b.element_size() == 2 else torch.int32))


def main():
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    comm = _strata.Comm(dist.distributed_c10d._get_default_group(), 30.0)
    assert (comm.rank, comm.size, comm.backend) == (rank, world, "c10d(gloo)"), (comm.rank, comm.backend)
    failures = []

    def check(name, ok):
        if not ok:
            failures.append(name)
            print("rank %d FAIL %s" % (rank, name), flush=True)

    count_sets = {"even": [5] * world, "uneven": [3 + 2 * r for r in range(world)],
                  "zeros": [0 if r % 2 else 4 * r + 1 for r in range(world)], "one_rank": [7] + [0] * (world - 1)}
    seed = 1
    for dt in ("fp32", "bf16", "fp16"):
        for cname, counts in count_sets.items():
            seed += 1
            total = sum(counts)
            off = [sum(counts[:r]) for r in range(world)]
            # reduce-scatter: three in flight at once, waited in reverse order.
            sends = [data(seed + k, rank, total, dt) for k in range(3)]
            recvs = [torch.full((counts[rank],), -1.0).to(DT[dt]) for _ in range(3)]
            hs = [comm.reduce_scatter_async(s.data_ptr(), r.data_ptr(), counts, dt) for s, r in zip(sends, recvs)]
            for h in reversed(hs):
                h.wait()
            for k in range(3):
                want = ordered_sum([data(seed + k, q, total, dt)[off[rank]:off[rank] + counts[rank]]
                                    for q in range(world)], dt)
                check("reduce_scatter %s %s #%d" % (dt, cname, k), same(recvs[k], want))
            # all-gather, with the send slice inside recv (allowed).
            recv = torch.zeros(total).to(DT[dt])
            mine = data(seed, rank, counts[rank], dt)
            recv[off[rank]:off[rank] + counts[rank]] = mine
            comm.all_gather_async(recv[off[rank]:].data_ptr(), recv.data_ptr(), counts, dt).wait()
            want = torch.cat([data(seed, q, counts[q], dt) for q in range(world)])
            check("all_gather %s %s" % (dt, cname), same(recv, want))
        for n in (0, 1, world - 1, 1000 + world):
            seed += 1
            buf = data(seed, rank, n, dt)
            comm.all_reduce_async(buf.data_ptr(), buf.data_ptr(), n, dt).wait()  # in place
            check("all_reduce %s n=%d" % (dt, n), same(buf, ordered_sum([data(seed, q, n, dt) for q in range(world)], dt)))
    for root in range(world):
        buf = data(100 + root, rank, 33, "fp32")
        comm.broadcast_async(buf.data_ptr(), 33, "fp32", root).wait()
        check("broadcast root %d" % root, same(buf, data(100 + root, root, 33, "fp32")))
    comm.barrier_async().wait()
    # Byte accounting (communicator.hpp): reduce-scatter and all-gather send
    # (sum(counts) - counts[rank]) * elem.
    before = comm.stats()["bytes_sent"]["reduce_scatter"]
    counts = [3 + r for r in range(world)]
    buf = torch.zeros(sum(counts))
    out = torch.zeros(counts[rank])
    comm.reduce_scatter_async(buf.data_ptr(), out.data_ptr(), counts, "fp32").wait()
    check("bytes", comm.stats()["bytes_sent"]["reduce_scatter"] - before == (sum(counts) - counts[rank]) * 4)
    # Bad input: counts of the wrong length is strata's InvalidArgumentError, before any traffic.
    try:
        comm.reduce_scatter_async(buf.data_ptr(), out.data_ptr(), [1], "fp32")
        check("bad counts raise", False)
    except strata.InvalidArgumentError as e:
        check("bad counts message", "counts for %d ranks" % world in str(e))
    comm.barrier_async().wait()
    print("rank %d: %s" % (rank, "PASS" if not failures else "%d FAILED" % len(failures)), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
