"""The exchange's copy alone: GPU to GPU, by buffer size, against the link's limit.

    python -m bench.exchange [--gpus 0 1] [--out FOLDER]
    python -m bench.exchange --allreduce [GPU ...]        # the N-way exchange beside NCCL

The copy each step of ``--sync host`` makes, alone.  Two processes,
each bound to one GPU as ``dual_mlp.py``'s workers are: the first allocates
a buffer with PyCUDA and sends its CUDA IPC handle over the project's zmq
link (``sockets.Peer``, ``dual_mlp.swap``); the second opens it and times device-to-device
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

``--allreduce`` times the whole exchange of ``--sync gpu`` instead: N
processes, one per GPU, each running ``stream_exchange``'s kernel (publish,
signal, reduce the N buffers, signal) on a buffer of each size, beside the
same N processes averaging it with NCCL's all-reduce (``torch.distributed``,
``ReduceOp.AVG``), each timed twice: launched from Python one at a time (the
host's rate, at small sizes) and replayed from a CUDA graph (the GPU's
time, as inside the training step, where XLA replays its recorded graph).
Every result is checked against the mean computed on the host (the
kernel's bit for bit); a rate that would put more on a GPU's links than
they carry stops the script.  On one GPU, ``--allreduce 0`` is the
exchange in a world of one (its own cost, no link), and ``--allreduce 0 0 0``
three workers time-sliced there, for correctness only.  Writes
``exchange_allreduce.json``.
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

from bench.common import OUT, ROOT, measured_by, parse_args, pyplot, record, refuse_busy_gpus, show
from multi_gpu.cli import Parser

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

    from dual_mlp import swap
    from multi_gpu.sockets import Peer
    drv.init()
    context = primary_context(drv, 0)
    src = gpu_memory(drv, (args.max_mb << 20) + 4, fill=True)
    peer = Peer(args.rundir, 0, 2, timeout=args.timeout)
    try:
        swap(peer, drv.mem_get_ipc_handle(src))
        swap(peer, "done", "the end of the copies")  # the reader is done with src
    finally:
        peer.close()
        src.free()
        context.pop()


def reader(args):
    """Process 2: opens the owner's buffer and times copies out of it."""
    import pycuda.driver as drv

    from dual_mlp import swap
    from multi_gpu.sockets import Peer
    drv.init()
    context = primary_context(drv, 0)
    peer = Peer(args.rundir, 1, 2, timeout=args.timeout)
    try:
        src = drv.IPCMemoryHandle(swap(peer, None)[0])
        dst = gpu_memory(drv, (args.max_mb << 20) + 4)
        rows = sweep(drv, src, dst, sizes(args.max_mb))
        src.close()
        dst.free()
        swap(peer, "done", "the end of the copies")
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


def together(commands, timeout, what):
    """Run ``commands`` ([(argv, the GPUs it sees)]) at once, to the end; each
    prints its figures as JSON on its last line, which this returns."""
    procs = [subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ,
                                                       CUDA_VISIBLE_DEVICES=",".join(gpus)),
                              stdout=subprocess.PIPE, text=True) for argv, gpus in commands]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode for p in procs):
        sys.exit(f"exchange.py: error: {what} failed (exits {[p.returncode for p in procs]})")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def run_workers(args):
    """The two-process sweep and the one-process sweep, each in its own processes."""
    me = [sys.executable, "-m", "bench.exchange", "--max-mb", str(args.max_mb),
          "--timeout", str(args.timeout)]
    with tempfile.TemporaryDirectory() as rundir:
        two = together([(me + ["--role", role, "--rundir", rundir], [gpu])
                        for role, gpu in (("owner", args.gpus[0]), ("reader", args.gpus[1]))],
                       args.timeout + 60, "a copy process")[1]
    (one,) = together([(me + ["--role", "single"], args.gpus)], args.timeout + 60,
                      "the one-process copy")
    return two, one


# -----------------------------------------------------------------------------
# --allreduce: the N-way exchange of --sync gpu beside NCCL's all-reduce

def allreduce_pattern(rank, n):
    """What worker ``rank`` holds before an exchange: exact in float32, and
    different for every worker and every element."""
    return np.float32(rank + 1) + (np.arange(n) % 1000).astype(np.float32)


def expected_mean(n_workers, n):
    """The mean every worker must hold after one exchange, summed in rank
    order in float32, as the kernel sums: bit for bit."""
    total = allreduce_pattern(0, n)
    for w in range(1, n_workers):
        total = total + allreduce_pattern(w, n)
    return total / np.float32(n_workers)


def replayable(stream, enqueue, times):
    """``times`` calls of ``enqueue()``, captured on the PyCUDA ``stream`` into
    a CUDA graph: a function that replays them on it, as XLA replays the
    training step's kernels, with no host between them."""
    from cuda.bindings import driver as cu

    from multi_gpu.stream_exchange import checked
    handle = cu.CUstream(stream.handle)
    checked(cu.cuStreamBeginCapture(handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
    for _ in range(times):
        enqueue()
    graph = checked(cu.cuStreamEndCapture(handle))
    runnable = checked(cu.cuGraphInstantiate(graph, 0))
    return lambda: checked(cu.cuGraphLaunch(runnable, handle))


def exchange_worker(args):
    """One of the N processes of the stream exchange's sweep: ``StreamExchange``'s
    kernel on a PyCUDA buffer, timed with CUDA events on its stream, launched
    from Python one at a time (the host's rate) and replayed from a CUDA graph
    (the GPU's)."""
    import pycuda.driver as drv

    from dual_mlp import barrier, swap_handles
    from multi_gpu.sockets import Peer
    from multi_gpu.stream_exchange import StreamExchange
    from multi_gpu.transports import Layout
    drv.init()
    context = primary_context(drv, 0)
    byte_sizes = sizes(args.max_mb)
    most = max(byte_sizes) // 4
    peer = Peer(args.rundir, args.rank, args.workers, timeout=args.timeout)
    ex = StreamExchange(args.rank, args.workers, Layout([(most,)], np.float32))
    buf = gpu_memory(drv, most * 4)
    stream, begin, end = drv.Stream(), drv.Event(), drv.Event()
    rows = []
    try:
        if args.workers == 1:
            ex.loopback()
        else:
            ex.connect(swap_handles(peer, drv, ex.send, ex.flags))
        for size in byte_sizes:
            n = size // 4
            drv.memcpy_htod(buf, allreduce_pattern(args.rank, n))
            barrier(peer)
            ex.launch(stream.handle, [(int(buf), n)])  # one exchange: its result is checked
            stream.synchronize()
            got = np.empty(n, np.float32)
            drv.memcpy_dtoh(got, buf)
            correct = bool(np.array_equal(got, expected_mean(args.workers, n)))
            r = repeats(size) if args.timed else 3

            def launch(n=n):  # (each binds this size's values: called in its own iteration)
                ex.launch(stream.handle, [(int(buf), n)])

            def timed(run, r=r):  # us per exchange
                barrier(peer)
                begin.record(stream)
                run()
                end.record(stream)
                end.synchronize()
                return end.time_since(begin) * 1e3 / r
            row = dict(bytes=size, repeats=r, us=timed(lambda r=r: [launch() for _ in range(r)]),
                       data_checked=correct)
            if args.timed:
                replay = replayable(stream, launch, r)
                replay()  # the first replay uploads the graph
                row["graph_us"] = timed(replay)
            rows.append(row)
        barrier(peer)  # every kernel done everywhere: the buffers may go
    finally:
        ex.close()
        buf.free()
        peer.close()
        context.pop()
    print(json.dumps(rows))


def nccl_worker(args):
    """One of the N processes of NCCL's sweep: ``torch.distributed.all_reduce``
    of the same buffer, averaging (``ReduceOp.AVG``), timed with CUDA events,
    called one at a time and replayed from a CUDA graph (``torch.cuda.graph``)."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("nccl", rank=args.rank, world_size=args.workers,
                            device_id=torch.device("cuda", 0))
    rows = []
    try:
        for size in sizes(args.max_mb):
            n = size // 4
            data = torch.from_numpy(allreduce_pattern(args.rank, n)).cuda()
            dist.all_reduce(data, dist.ReduceOp.AVG)
            # NCCL's own order of sums, and its average by a premultiplied 1 / N
            correct = bool(np.allclose(data.cpu().numpy(), expected_mean(args.workers, n),
                                       rtol=1e-6, atol=0))
            r = repeats(size)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def all_reduces(r=r, data=data):  # (each binds this size's values)
                for _ in range(r):
                    dist.all_reduce(data, dist.ReduceOp.AVG)

            def timed(run, r=r, begin=begin, end=end):  # us per all-reduce
                dist.barrier()
                begin.record()
                run()
                end.record()
                end.synchronize()
                return begin.elapsed_time(end) * 1e3 / r
            row = dict(bytes=size, repeats=r, us=timed(all_reduces), data_checked=correct)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                all_reduces()
            graph.replay()
            row["graph_us"] = timed(graph.replay)
            rows.append(row)
    finally:
        dist.destroy_process_group()
    print(json.dumps(rows))


def run_allreduce(args):
    """Both sweeps, each in one process per worker; returns the rows by size."""
    from multi_gpu.nodes import free_port
    gpus = args.allreduce or [str(i) for i in range(gpu_count())]
    n, shared = len(gpus), len(set(gpus)) < len(gpus)
    me = [sys.executable, "-m", "bench.exchange", "--max-mb", str(args.max_mb),
          "--timeout", str(args.timeout), "--workers", str(n)]

    def sweep_of(role, extra):
        return together([(me + ["--role", role, "--rank", str(k)] + extra, [gpu])
                         for k, gpu in enumerate(gpus)], args.timeout + 120,
                        f"an --allreduce {role}")

    with tempfile.TemporaryDirectory() as rundir:
        ours = sweep_of("exchange-worker", ["--rundir", rundir] + ([] if shared else ["--timed"]))
    nccl = None if shared else sweep_of("nccl-worker", ["--port", str(free_port())])
    rows = []
    for i, size in enumerate(sizes(args.max_mb)):
        row = dict(bytes=size)
        for system, workers in (("stream_exchange", ours), ("nccl", nccl)):
            if workers:  # the slowest worker's figures
                row[f"{system}_us"] = max(w[i]["us"] for w in workers)
                row[f"{system}_checked"] = all(w[i]["data_checked"] for w in workers)
                if "graph_us" in workers[0][i]:
                    row[f"{system}_graph_us"] = max(w[i]["graph_us"] for w in workers)
        rows.append(row)
    return gpus, shared, rows


def link_rates(rows, n):
    """The link's load per GPU, GB/s one way, that each figure implies: the
    one-shot exchange reads the N - 1 others' buffers; NCCL's all-reduce
    moves 2 (N - 1) / N of the buffer (its bus bandwidth)."""
    checks = []
    for row in rows:
        for system, moved in (("stream_exchange", n - 1), ("nccl", 2 * (n - 1) / n)):
            for timing in ("us", "graph_us"):
                if f"{system}_{timing}" in row:
                    checks.append(dict(bytes=row["bytes"], data_checked=row[f"{system}_checked"],
                                       gbps=moved * row["bytes"] / row[f"{system}_{timing}"] / 1e3))
    return checks


def allreduce_table(document):
    """The Markdown table of an exchange_allreduce.json."""
    timed = document["timed"]
    n = document["workers"]
    head = (f"{measured_by(document)}: {n} "
            f"worker{'s' if n > 1 else ''} on GPU{'s' if len(set(document['gpus'])) > 1 else ''}"
            f" {' '.join(document['gpus'])}; microseconds per all-reduce, every "
            "result checked" + ("" if timed else " (workers time-sliced on one GPU: correctness "
                                                 "only, the times are not a result)") + ".")
    lines = [head, "", "| bytes | the demo's exchange (one kernel): replayed from a CUDA graph | "
             "launched one at a time | NCCL all-reduce (AVG): replayed from a CUDA graph | "
             "called one at a time |", "| --- | --- | --- | --- | --- |"]

    def us(row, key):
        return f"{row[key]:.1f}" if key in row else "not run"
    for row in document["rows"]:
        mark = " (the MLP's weights)" if row["bytes"] == document["mlp_bytes"] else ""
        lines.append(f"| {row['bytes']:,}{mark} | " + " | ".join(
            us(row, key) for key in ("stream_exchange_graph_us", "stream_exchange_us",
                                     "nccl_graph_us", "nccl_us")) + " |")
    return "\n".join(lines)


def plot(series, limit, path):
    plt = pyplot()
    if plt is None:
        return
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
    """The Markdown table of an exchange.json (or of an exchange_allreduce.json)."""
    if "rows" in document:
        return allreduce_table(document)
    limit = document["link_limit_gbps"]
    lines = [f"{measured_by(document)}; the link's limit "
             f"{limit:.0f} GB/s one way ({document['link_limit_source']}); every copy checked.",
             "", "| bytes per copy | two processes, CUDA IPC (GB/s) | one process, peer copy "
             "(GB/s) | share of the link |", "| --- | --- | --- | --- |"]
    for a, b in zip(document["two_processes"], document["one_process"]):
        mark = " (the MLP's weights)" if a["bytes"] == document["mlp_bytes"] else ""
        lines.append(f"| {a['bytes']:,}{mark} | {a['gbps']:.1f} | {b['gbps']:.1f} | "
                     f"{a['gbps'] / limit:.0%} |")
    return "\n".join(lines)


def power_of_two(text):
    """--max-mb: checked as it is parsed, before the benchmark looks for GPUs."""
    try:
        mb = int(text)
    except ValueError:
        mb = 0
    if not 0 < mb <= 1024 or math.log2(mb) % 1:
        raise argparse.ArgumentTypeError("must be a power of two, at most 1024")
    return mb


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--gpus", nargs=2, default=["0", "1"], metavar="GPU",
                        help="the two GPUs (default: 0 1)")
    parser.add_argument("--max-mb", type=power_of_two, default=256,
                        help="largest copy, MB, a power of two up to 1024 (default 256)")
    parser.add_argument("--link-gbps", type=float, default=450.0,
                        help="the link's one-way limit where nvidia-smi reports none "
                             "(default 450: H200 NVLink, 18 links x 25 GB/s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per process")
    parser.add_argument("--out", default=OUT, help="folder for exchange.json and .png")
    parser.add_argument("--allreduce", nargs="*", metavar="GPU",
                        help="instead: the N-way exchange of --sync gpu beside NCCL's "
                             "all-reduce, one worker per GPU listed (default: every GPU; a GPU "
                             "named twice time-slices, for correctness only)")
    for hidden in ("--role", "--rundir", "--rank", "--workers", "--port"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--timed", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(parser, table)
    if args.role:
        args.rank, args.workers = int(args.rank or 0), int(args.workers or 2)
        return {"owner": owner, "reader": reader, "single": single,
                "exchange-worker": exchange_worker, "nccl-worker": nccl_worker}[args.role](args)
    refuse_busy_gpus()
    if args.allreduce is not None:
        return allreduce_main(args)
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


def allreduce_main(args):
    gpus, shared, rows = run_allreduce(args)
    limit, source = link_limit(gpus[0], args.link_gbps)
    if not shared:
        refuse(link_rates(rows, len(gpus)), limit, "--allreduce")
    elif not all(r["stream_exchange_checked"] for r in rows):
        sys.exit("exchange.py: error: --allreduce: the exchange's result is wrong")
    path = record("exchange_allreduce", args.out, block="exchange.py --allreduce", gpus=gpus,
                  workers=len(gpus), timed=not shared, link_limit_gbps=limit,
                  link_limit_source=source, mlp_bytes=MLP_BYTES, rows=rows)
    show(path, allreduce_table)


def gpu_count():
    import pycuda.driver as drv
    drv.init()
    return drv.Device.count()


if __name__ == "__main__":
    main()
