"""The exchange's copy alone: GPU to GPU, by buffer size, against the link's limit.

    python bench/exchange.py [--gpus 0 1] [--out bench/results]

The 2014 demo's ``time_copy_proc.py`` brought up to date.  Two processes,
each bound to one GPU as ``dual_mlp.py``'s workers are: the first allocates
a buffer with PyCUDA and sends its CUDA IPC handle over the project's zmq
link (``exchange.Peer``); the second opens it and times device-to-device
copies from it into its own memory (the peer-to-peer pull every step of the
demo makes), with CUDA events on the copying stream.  Beside it, the same
copies in one process that sees both GPUs (a plain peer copy).  Sizes from
4 KB to 256 MB, and the MLP's own weights (1.59 MB).

Every copy is checked: the destination is cleared before each size and read
back after it, and must hold the source's pattern exactly, with the byte
after it untouched.  A rate above the link's limit (read from ``nvidia-smi
nvlink``, or ``--link-gbps``) is a timing error, not a result: the script
stops with an error and writes no figures.  Writes ``exchange.json`` and
``exchange.png``; ``--tables-from JSON`` regenerates the tables of README.md
and bench/README.md from one.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from common import RESULTS, ROOT, parse_args, record, refuse_busy_gpus

sys.path.insert(0, ROOT)  # first: `import exchange` is the project's module, not this script

SIZES = [4 << 10 << 2 * k for k in range(10)]  # 4 KB, 16 KB, ... 1 GB: cut to --max-mb
MLP_BYTES = (784 * 500 + 500 + 500 * 10 + 10) * 4
BYTES_PER_SIZE = 2 << 30  # timed bytes per size: enough that small copies repeat often


def sizes(max_mb):
    return sorted([s for s in SIZES if s <= max_mb << 20] + [MLP_BYTES])


def repeats(size):
    return max(10, min(2000, BYTES_PER_SIZE // size))


def pattern(n_words):
    """What the source holds: every 32-bit word its own index, so that a
    copy from the wrong place or of the wrong length shows."""
    return np.arange(n_words, dtype=np.uint32)


def sweep(drv, src, dst, byte_sizes):
    """Time ``repeats(size)`` copies src -> dst per size on one stream, with
    CUDA events, and check the copied bytes.  ``src`` may be another GPU's
    memory (an opened IPC handle or a peer allocation): unified addressing
    makes the copy a peer copy.  Returns [{bytes, gbps, ...}]."""
    stream, begin, end = drv.Stream(), drv.Event(), drv.Event()
    expected = pattern(max(byte_sizes) // 4 + 1)
    rows = []
    for size in byte_sizes:
        n = size // 4
        drv.memset_d32(dst, 0xFFFFFFFF, n + 1)
        drv.memcpy_dtod_async(dst, src, size, stream)  # warm-up: maps, enables peer access
        stream.synchronize()
        r = repeats(size)
        begin.record(stream)
        for _ in range(r):
            drv.memcpy_dtod_async(dst, src, size, stream)
        end.record(stream)
        end.synchronize()
        seconds = end.time_since(begin) / 1e3
        got = np.empty(n + 1, np.uint32)
        drv.memcpy_dtoh(got, dst)
        correct = bool(np.array_equal(got[:n], expected[:n]) and got[n] == 0xFFFFFFFF)
        rows.append(dict(bytes=size, repeats=r, seconds=seconds, gbps=size * r / seconds / 1e9,
                         data_checked=correct))
    return rows


def gpu_memory(drv, n_bytes, fill=False):
    buf = drv.mem_alloc(n_bytes)
    if fill:
        drv.memcpy_htod(buf, pattern(n_bytes // 4))
    return buf


def primary_context(drv, index):
    context = drv.Device(index).retain_primary_context()
    context.push()
    return context


def owner(args):
    """Process 1: holds the source buffer and shares it by CUDA IPC."""
    import pycuda.driver as drv
    from exchange import Peer
    from launcher import stopping
    drv.init()
    context = primary_context(drv, 0)
    src = gpu_memory(drv, (args.max_mb << 20) + 4, fill=True)
    peer = Peer(args.rundir, 0, args.timeout, stopping)
    try:
        peer.exchange(drv.mem_get_ipc_handle(src))
        peer.exchange("done", "the end of the copies")  # the reader is done with src
    finally:
        peer.close()
        src.free()
        context.pop()


def reader(args):
    """Process 2: opens the owner's buffer and times copies out of it."""
    import pycuda.driver as drv
    from exchange import Peer
    from launcher import stopping
    drv.init()
    context = primary_context(drv, 0)
    peer = Peer(args.rundir, 1, args.timeout, stopping)
    try:
        src = drv.IPCMemoryHandle(peer.exchange(None))
        dst = gpu_memory(drv, (args.max_mb << 20) + 4)
        rows = sweep(drv, src, dst, sizes(args.max_mb))
        src.close()
        dst.free()
        peer.exchange("done", "the end of the copies")
    finally:
        peer.close()
        context.pop()
    print(json.dumps(rows))


def single(args):
    """One process, both GPUs: a plain peer copy, for comparison."""
    import pycuda.driver as drv
    drv.init()
    first = primary_context(drv, 0)
    src = gpu_memory(drv, (args.max_mb << 20) + 4, fill=True)
    first.pop()
    second = primary_context(drv, 1)
    second.enable_peer_access(first)
    dst = gpu_memory(drv, (args.max_mb << 20) + 4)
    rows = sweep(drv, src, dst, sizes(args.max_mb))
    dst.free()
    second.pop()
    print(json.dumps(rows))


def link_limit(gpu, assumed):
    """GB/s one way between the two GPUs: the sum of ``nvidia-smi nvlink -s``'s
    per-link rates for ``gpu``, or ``assumed`` where it reports none."""
    try:
        out = subprocess.run(["nvidia-smi", "nvlink", "-s", "-i", str(gpu)], capture_output=True,
                             text=True, timeout=30).stdout
    except OSError:
        out = ""
    rates = [float(r) for r in re.findall(r"Link \d+: ([\d.]+) GB/s", out)]
    if rates:
        return sum(rates), f"nvidia-smi nvlink -s -i {gpu}: {len(rates)} links"
    return assumed, "--link-gbps (nvidia-smi reported no NVLink rates)"


def refuse(rows, limit, what):
    """Stop on a figure that cannot be: wrong data, or faster than the link."""
    for row in rows:
        size = f"{row['bytes']:,} bytes"
        if not row["data_checked"]:
            sys.exit(f"exchange.py: error: {what}: the copied data is wrong at {size}")
        if row["gbps"] > limit:
            sys.exit(f"exchange.py: error: {what}: {row['gbps']:.0f} GB/s at {size} is past the "
                     f"link's {limit:.0f} GB/s: a timing error, not a result")


def run_workers(args):
    """The two-process sweep and the one-process sweep, each in its own processes."""
    me = [sys.executable, os.path.abspath(__file__), "--max-mb", str(args.max_mb),
          "--timeout", str(args.timeout)]
    gpu_env = lambda gpus: dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))  # noqa: E731
    with tempfile.TemporaryDirectory() as rundir:
        procs = [subprocess.Popen(me + ["--role", role, "--rundir", rundir],
                                  env=gpu_env([gpu]), stdout=subprocess.PIPE, text=True)
                 for role, gpu in (("owner", args.gpus[0]), ("reader", args.gpus[1]))]
        try:
            outs = [p.communicate(timeout=args.timeout + 60)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        if any(p.returncode for p in procs):
            sys.exit(f"exchange.py: error: a copy process failed (exits "
                     f"{[p.returncode for p in procs]})")
    two = json.loads(outs[1].strip().splitlines()[-1])
    out = subprocess.run(me + ["--role", "single"], env=gpu_env(args.gpus), stdout=subprocess.PIPE,
                         text=True, timeout=args.timeout + 60)
    if out.returncode:
        sys.exit(f"exchange.py: error: the one-process copy failed (exit {out.returncode})")
    return two, json.loads(out.stdout.strip().splitlines()[-1])


def plot(series, limit, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, rows in series.items():
        ax.plot([r["bytes"] for r in rows], [r["gbps"] for r in rows], marker="o", label=label)
    ax.axhline(limit, color="k", linestyle="--", linewidth=1, label=f"link limit {limit:.0f} GB/s")
    ax.axvline(MLP_BYTES, color="gray", linestyle=":", label="the MLP's weights (1.59 MB)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per copy")
    ax.set_ylabel("GB/s")
    ax.set_title("GPU to GPU copy, by size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(document):
    """The Markdown table of an exchange.json."""
    limit = document["link_limit_gbps"]
    lines = [f"Measured by `{document['command']}` on {document['date'][:10]}; the link's limit "
             f"{limit:.0f} GB/s one way ({document['link_limit_source']}); every copy checked.",
             "", "| bytes per copy | two processes, CUDA IPC (GB/s) | one process, peer copy "
             "(GB/s) | share of the link |", "| --- | --- | --- | --- |"]
    for a, b in zip(document["two_processes"], document["one_process"]):
        mark = " (the MLP's weights)" if a["bytes"] == document["mlp_bytes"] else ""
        lines.append(f"| {a['bytes']:,}{mark} | {a['gbps']:.1f} | {b['gbps']:.1f} | "
                     f"{a['gbps'] / limit:.0%} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", nargs=2, default=["0", "1"], metavar="GPU",
                        help="the two GPUs (default: 0 1)")
    parser.add_argument("--max-mb", type=int, default=256, help="largest copy, MB (default 256)")
    parser.add_argument("--link-gbps", type=float, default=450.0,
                        help="the link's one-way limit where nvidia-smi reports none "
                             "(default 450: H200 NVLink, 18 links x 25 GB/s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per process")
    parser.add_argument("--out", default=RESULTS, help="folder for exchange.json and .png")
    parser.add_argument("--role", choices=("owner", "reader", "single"), help=argparse.SUPPRESS)
    parser.add_argument("--rundir", help=argparse.SUPPRESS)
    args = parse_args(parser, table)
    if args.role:
        return {"owner": owner, "reader": reader, "single": single}[args.role](args)
    if not 0 < args.max_mb <= 1024 or math.log2(args.max_mb) % 1:
        parser.error("--max-mb must be a power of two, at most 1024")
    refuse_busy_gpus()
    two, one = run_workers(args)
    limit, source = link_limit(args.gpus[0], args.link_gbps)
    refuse(two, limit, "two processes")
    refuse(one, limit, "one process")
    for a, b in zip(two, one):
        print(f"{a['bytes']:>12,} bytes: two processes (IPC) {a['gbps']:7.1f} GB/s, "
              f"one process {b['gbps']:7.1f} GB/s  ({a['gbps'] / limit:.0%} of the link)")
    series = {"two processes, CUDA IPC (the demo)": two, "one process, peer copy": one}
    record("exchange", args.out, gpus=args.gpus, link_limit_gbps=limit, link_limit_source=source,
           mlp_bytes=MLP_BYTES, two_processes=two, one_process=one)
    plot(series, limit, os.path.join(args.out, "exchange.png"))


if __name__ == "__main__":
    main()
