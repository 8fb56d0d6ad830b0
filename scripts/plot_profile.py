#!/usr/bin/python3
"""Turns `strata profile --json` output into PNG plots.

Usage: scripts/plot_profile.py PROFILE.json [-o OUT_DIR]   (JSON from a file, or - for stdin)

Writes into OUT_DIR (default: the current directory):
  profile_nvme.png     NVMe throughput vs block size, one line per queue depth; one row per
                       path/engine/ring count, read and write side by side
  profile_step.png     the sample step: predicted vs measured (each repeat a dot), serial and
                       pipelined, with the error (and the multi-rank engine check under mpirun);
                       and the configured step's predicted legs and transfer overhead
  profile_copies.png   host <-> device bandwidth vs size (only when a GPU was measured)
Needs matplotlib (Debian: python3-matplotlib; run with /usr/bin/python3).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def human_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:g} {unit}"
    return f"{n} B"



def save(fig, out, name):
    """Lays the figure out, writes it to out/name (110 dpi), closes it; returns the path."""
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def plot_nvme(report, out):
    points = report["nvme"]["points"]
    if not points:
        return None
    groups = {}
    for p in points:
        groups.setdefault((p["path"], p["engine"], p["rings"]), []).append(p)
    keys = sorted(groups)
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3.2 * len(keys)), squeeze=False)
    for row, key in enumerate(keys):
        path, engine, rings = key
        for col, op in enumerate(("read", "write")):
            ax = axes[row][col]
            pts = [p for p in groups[key] if p["op"] == op]
            qds = sorted({p["queue_depth"] for p in pts})
            for qd in qds:
                line = sorted((p["block_size"], p["bytes_per_second"]) for p in pts if p["queue_depth"] == qd)
                if len(line) < 1:
                    continue
                ax.plot([b for b, _ in line], [v / 1e9 for _, v in line], marker="o", label=f"qd {qd}")
            ax.set_xscale("log", base=2)
            bss = sorted({p["block_size"] for p in pts})
            ax.set_xticks(bss)
            ax.set_xticklabels([human_bytes(b) for b in bss], fontsize=7)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("block size")
            ax.set_ylabel("GB/s")
            ax.set_title(f"{op}: {engine} x{rings}, {path}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
    env = report["environment"]
    fig.suptitle(f"NVMe through the strata I/O engine ({env.get('cpu_model', '')}, "
                 f"load {env.get('load_average_1m', 0):.2f})", fontsize=10)
    return save(fig, out, "profile_nvme.png")


def plot_step(report, out):
    s = report["sample_step"]
    m = report["model"]["configured"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    runs = [("serial", s["serial"]), ("pipelined", s["pipelined"])]
    eng = s.get("engine_step", {})
    if eng.get("ran"):
        runs += [("zero step\nserial", eng["serial"]), ("zero step\npipelined", eng["pipelined"])]
    check = report.get("engine_check", {})
    if check.get("ran"):
        runs.append((f"engine check\n{check['ranks']} ranks", check))
    x = range(len(runs))
    pred = [r["predicted_s"] for _, r in runs]
    meas = [r["measured_median_s"] for _, r in runs]
    ax1.bar([i - 0.18 for i in x], pred, width=0.36, label="predicted", color="#4c72b0")
    ax1.bar([i + 0.18 for i in x], meas, width=0.36, label="measured (median)", color="#dd8452")
    for i, (_, r) in enumerate(runs):
        dots = r.get("measured_s") or []
        ax1.scatter([i + 0.18] * len(dots), dots, color="black", s=10, zorder=3)
        ax1.annotate(f"{r['error'] * 100:+.1f}%", (i, max(pred[i], meas[i])), ha="center",
                     va="bottom", fontsize=9)
    ax1.set_xticks(list(x))
    ax1.set_xticklabels([name for name, _ in runs], fontsize=8)
    ax1.set_ylabel("seconds")
    ax1.set_title(f"sample step: {s['sub_groups']} sub-groups x {s['elements_per_sub_group'] / 1e6:g}M "
                  f"elements, state on NVMe", fontsize=9)
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)

    legs = [("nvme read", m["nvme_read_s"]), ("adam", m["adam_s"]), ("nvme write", m["nvme_write_s"]),
            ("h2d", m["host_to_device_s"]), ("d2h", m["device_to_host_s"]), ("network", m["network_s"])]
    bottom = 0.0
    for name, v in legs:
        if v > 0:
            ax2.bar(0, v, bottom=bottom, label=name, width=0.5)
            bottom += v
    ax2.bar(1, m["optimizer_step_pipelined_s"], width=0.5, color="#55a868", label="pipelined step")
    if m["network_s"] > 0:
        ax2.bar(1, m["network_s"], bottom=m["optimizer_step_pipelined_s"], width=0.5, color="#d62728",
                alpha=0.6, label="network (pipelined column)")
    overhead = m["transfer_overhead_pipelined_s"]
    ax2.bar(2, overhead, width=0.5, color="#8172b2", label="transfer overhead (pipelined)")
    ax2.annotate(f"{overhead:.3g} s", (2, overhead), ha="center", va="bottom", fontsize=9)
    ax2.set_xticks([0, 1, 2])
    ax2.set_xticklabels(["serial (legs summed)", "pipelined", "overhead"])
    ax2.set_ylabel("seconds per step, per rank")
    ax2.set_title(f"configured: {report['model']['layout']}, {m['sub_groups']} sub-groups", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(axis="y", alpha=0.3)
    return save(fig, out, "profile_step.png")


def plot_copies(report, out):
    pts = report["host_device_copies"]["points"]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for direction in ("host_to_device", "device_to_host"):
        for pinned in (True, False):
            line = sorted((p["bytes"], p["bytes_per_second"]) for p in pts
                          if p["direction"] == direction and p["pinned"] == pinned)
            if line:
                ax.plot([b for b, _ in line], [v / 1e9 for _, v in line], marker="o",
                        label=f"{direction} {'pinned' if pinned else 'pageable'}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per copy")
    ax.set_ylabel("GB/s")
    ax.set_title(f"host <-> device: {report['environment']['gpu']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out, "profile_copies.png")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="strata profile --json output (- for stdin)")
    ap.add_argument("-o", "--out", default=".", help="output directory")
    args = ap.parse_args()
    try:
        report = json.load(sys.stdin if args.json == "-" else open(args.json))
    except (OSError, ValueError) as e:
        print(f"plot_profile: cannot read {args.json}: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for f in (plot_nvme, plot_step, plot_copies):
        path = f(report, args.out)
        if path:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
