"""An elastic run beside torchrun's: a node lost for good, the run going on
with the nodes it has, and the node's command started again, taken back in.

    python -m bench.elastic [--dataset DIR] [--out DIR]     (as root: test hosts)

Two test hosts (``bench/testhosts.py``), two CPU workers each, and the same
model, data, minibatches and SGD in two systems, one after the other:

* the demo: ``python dual_mlp.py cpu cpu --nodes 1:2 --max-restarts 3
  --rejoin-timeout 2``, node 0 with ``--save``;
* torchrun ``--nnodes 1:2 --nproc-per-node 2 --max-restarts 3``, its c10d
  rendezvous hosted by node 0, at its best settings (``TORCH_RENDEZVOUS``;
  ``TORCH_STORE``, without which a node started again never got in), each
  worker DistributedDataParallel over gloo (``ddp_worker``), saving a
  checkpoint at every epoch's end and loading it at every start, as
  torchrun asks of its users' scripts; the checkpoint on storage both hosts
  read (a shared file system), where the demo's travels with the run.
  PyTorch's CPU build: ``pip install torch --index-url
  https://download.pytorch.org/whl/cpu``.

Once node 0 has reported epoch ``LOST_AT``, node 1's machine is killed
(every process in it); once the run has reported ``ALONE`` more epochs
without it, node 1's command is started again.  Measured: the seconds from
the kill to the workers training again without node 1, and from the
command started again to four workers training; how each node ended; and
whether the run ends where its oracle does: the same epochs trained in
three stages on the loopback, each saved and resumed with the next world,
where the run's own lines say it restarted (``stages``).
Writes ``elastic.json`` into ``--out`` (default: ``out/``).
"""
import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import mlp
from bench.common import DEBIAN_FASHION, OUT, measured_by, needed, record, show
from bench.lost_node import under_load
from bench.testhosts import host_arguments, hosts_on_a_bridge
from multi_gpu.cli import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "the secret of an elastic benchmark's runs"
EPOCHS, LOST_AT, ALONE = 16, 3, 3
TRAINING = dict(batch=100, learning_rate=0.1, l2=1e-4)  # both systems alike
REJOIN_S = 2  # the demo waits this long for a lost node before it goes on without it
TORCH_PORT = 29400
# torchrun at its best here: a round closes a second after the fewest nodes met, a node
# silent for 5 s (the demo's bound) is out of it
TORCH_RENDEZVOUS = ("last_call_timeout=1,join_timeout=120,keep_alive_interval=1,"
                    "keep_alive_max_attempt=5")
DEMO_PORT = 29500
# torchrun's workers keep no connection to the rendezvous' store (shared with them by
# default, a store a node's return never got through: the run timed out)
TORCH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# torchrun's workers run ``-m bench.elastic`` from the run's folder
PYTHONPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))


def demo(rank, node0, epochs, dataset, nodes="1:2", *extra):
    """README.md's command for node ``rank`` of a run of ``nodes`` nodes
    ("1:2": elastic) of two CPU workers each."""
    several = ["--nodes", nodes, "--node-rank", str(rank), "--coordinator",
               f"{node0}:{DEMO_PORT}"] if nodes != "1" else ["--exchange", "xla"]  # as on several
    elastic = ["--max-restarts", "3", "--rejoin-timeout", str(REJOIN_S)] if ":" in nodes else []
    return [sys.executable, os.path.join(ROOT, "dual_mlp.py"), "cpu", "cpu", *several, *elastic,
            "--dataset", dataset, "--epochs", str(epochs), "--batch-size", str(TRAINING["batch"]),
            "--learning-rate", str(TRAINING["learning_rate"]), "--l2", str(TRAINING["l2"]),
            *(("--save", "m.npz") if rank == 0 else ()), *extra]


def torchrun(rank, node0, epochs, dataset, nodes="1:2", address="127.0.0.1"):
    """torchrun's command for node ``rank`` (at ``address``) of a run of
    ``nodes`` nodes of two workers each: its rendezvous at node 0."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nodes,
            "--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{node0}:{TORCH_PORT}", "--rdzv-id", "elastic-bench",
            "--rdzv-conf", f"{TORCH_RENDEZVOUS},is_host={rank == 0}",
            "--local-addr", address,
            "--monitor-interval", "0.1", "-m", "bench.elastic", "--ddp-worker",
            "--dataset", dataset, "--epochs", str(epochs)]


class Node:
    """A node's command in a test host (or on this machine), its lines timed
    as they come (stdout and stderr as one)."""

    def __init__(self, command, host=None, cwd=None):
        self.lines, self.started = [], time.monotonic()
        self.proc = subprocess.Popen(host.runs(command) if host else command, cwd=cwd,
                                     env=dict(os.environ, DUAL_MLP_SECRET=SECRET,
                                              PYTHONPATH=PYTHONPATH, **TORCH_STORE),
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def ended(self, timeout=300):
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        self.reader.join()
        return code


def first(nodes, pattern, after=0.0, timeout=300):
    """When (monotonic) any of ``nodes`` first printed a line matching
    ``pattern`` after ``after``, and the match."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [(at, m) for node in nodes for at, line in list(node.lines)
                 if at >= after and (m := re.search(pattern, line))]
        if found:
            return min(found, key=lambda f: f[0])
        if all(node.proc.poll() is not None for node in nodes):
            break
        time.sleep(0.05)
    raise RuntimeError(f"never printed {pattern!r}: {said(nodes)[-3000:]}")


def said(nodes):
    """What ``nodes`` printed, in the order it came."""
    return "".join(line for _, line in sorted(pair for node in nodes for pair in node.lines))


# what each system prints as its workers start training, as one restarts them from an
# epoch, and at each epoch's end: the demo's lines, and ``ddp_worker``'s in the same words
TRAINING_LINE = r"\.\.\. training: (\d+) workers"
RESTART_LINE = r"(?:restarting every worker from .*? at epoch|training: \d+ workers from epoch) " \
               r"(\d+)"
EPOCH_LINE = r"^epoch {}/"


def elastic_run(system, folder, dataset):
    """One run of ``system`` ("demo" or "torchrun") on two test hosts: node
    1's machine killed once the run has reported epoch ``LOST_AT``, and
    its command started again ``ALONE`` epochs after the run went on."""
    with hosts_on_a_bridge(2) as hosts:
        def command(rank):
            if system == "demo":
                return demo(rank, hosts[0].address, EPOCHS, dataset)
            return torchrun(rank, hosts[0].address, EPOCHS, dataset,
                            address=hosts[rank].address)
        nodes = [Node(command(rank), hosts[rank], folder) for rank in (0, 1)]
        try:
            first(nodes, EPOCH_LINE.format(LOST_AT), timeout=600)
            hosts[1].signal(signal.SIGKILL)
            lost = time.monotonic()
            shrunk, alone = first(nodes[:1], TRAINING_LINE, after=lost)
            restarted = int(first(nodes[:1], RESTART_LINE, after=lost)[1][1])
            first(nodes[:1], EPOCH_LINE.format(restarted + ALONE), after=shrunk)
            nodes.append(Node(command(1), hosts[1], folder))
            grown, back = first([nodes[0], nodes[2]], TRAINING_LINE, after=nodes[2].started)
            codes = [nodes[0].ended(), nodes[2].ended()]
        finally:
            for host in hosts:
                host.signal(signal.SIGKILL)
            for node in nodes:
                node.ended(10)
        for left in glob.glob(f"/dev/shm/dual_mlp-{nodes[1].proc.pid}-*"):
            shutil.rmtree(left, ignore_errors=True)
    lines = said([nodes[0], nodes[2]])
    # the epochs each world started from: node 0's restarts (every node says them), or
    # each start's (its worker 0's, on either node) after the first
    restarts = [int(m[1]) for m in re.finditer(RESTART_LINE, said(nodes[:1]) if system == "demo"
                                                else lines)]
    return dict(system=system, shrunk_after_s=round(shrunk - lost, 2),
                workers_alone=int(alone[1]), grown_after_s=round(grown - nodes[2].started, 2),
                workers_back=int(back[1]), exit_codes=codes,
                restart_epochs=restarts if system == "demo" else restarts[1:],
                lines=lines[-8000:])


def stages(system, folder, dataset, ends):
    """The oracle: the epochs up to each of ``ends`` trained in a stage of
    its own on this machine, two nodes, then one, then two, each resumed
    from the last one's checkpoint.  Returns the stages' exit codes."""
    codes = []
    for i, last in enumerate(ends):
        n = "1" if i % 2 else "2"
        resume = ("--resume", "m.npz") if i else ()
        commands = [demo(rank, "127.0.0.1", last, dataset, n, *resume) if system == "demo"
                    else torchrun(rank, "127.0.0.1", last, dataset, n)
                    for rank in range(int(n))]
        nodes = [Node(c, cwd=folder) for c in commands]
        codes.append([node.ended() for node in nodes])
    return codes


def weights(system, path):
    """The trained weights in a run's checkpoint."""
    if system == "demo":
        from multi_gpu import records
        return records.load_checkpoint(path, mlp.parameter_shapes(784, 500, 10))[0]
    import torch
    return [p.numpy() for p in torch.load(path)["params"]]


def measure(system, dataset):
    """The elastic run and its oracle, each in a folder of its own."""
    with tempfile.TemporaryDirectory() as run, tempfile.TemporaryDirectory() as oracle:
        figures = elastic_run(system, run, dataset)
        ends = [*figures["restart_epochs"][:2], EPOCHS]
        figures["oracle_exit_codes"] = stages(system, oracle, dataset, ends)
        name = "m.npz" if system == "demo" else "ck.pt"
        ran, wanted = (weights(system, os.path.join(f, name)) for f in (run, oracle))
        figures["max_difference_to_oracle"] = float(max(np.abs(a - b).max()
                                                        for a, b in zip(ran, wanted)))
    return figures


def ddp_worker(args):
    """A worker of torchrun's run: DistributedDataParallel over gloo on the
    demo's model, minibatches and SGD (``bench.references.TorchModel``),
    worker k of W training minibatches k, k + W, ... of each epoch; from
    ``ck.pt`` where it is, which worker 0 writes at every epoch's end."""
    import torch
    import torch.distributed as dist

    from bench import references
    from multi_gpu import datasets
    references.CPU = True
    torch.set_num_threads(1)  # two workers a host, as the demo's launcher shares the cores out
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (x, y), _, _ = datasets.read(args.dataset)
    model = references.TorchModel(x, y, rank)
    model.reset()
    start = 0
    if os.path.exists("ck.pt"):
        saved = torch.load("ck.pt")
        start = saved["epoch"]
        with torch.no_grad():
            for p, v in zip(model.layers.parameters(), saved["params"]):
                p.copy_(v)
    ddp = torch.nn.parallel.DistributedDataParallel(model.layers)
    sgd = torch.optim.SGD(ddp.parameters(), lr=TRAINING["learning_rate"])
    hyper = references.Hyper(TRAINING["learning_rate"], TRAINING["l2"])
    batch, steps = TRAINING["batch"], len(x) // TRAINING["batch"] // world
    if rank == 0:
        print(f"... training: {world} workers from epoch {start}", flush=True)
    for epoch in range(start + 1, args.epochs + 1):
        for step in range(steps):
            first_row = (step * world + rank) * batch
            loss = model.loss(ddp, model.x[first_row:first_row + batch],
                              model.y[first_row:first_row + batch], hyper)
            sgd.zero_grad(set_to_none=True)
            loss.backward()
            sgd.step()
        if rank == 0:
            torch.save(dict(epoch=epoch, params=[p.detach().clone()
                                                 for p in model.layers.parameters()]), "ck.tmp")
            os.replace("ck.tmp", "ck.pt")
            print(f"epoch {epoch}/{args.epochs}: {world} workers", flush=True)
    dist.destroy_process_group()


def table(document):
    lines = [f"{measured_by(document)}: two test hosts, two CPU workers each; node 1's machine "
             f"killed after epoch {document['lost_at']}, its command started again "
             f"{document['alone']} epochs later; the oracle: the same epochs in three stages, "
             f"each resumed from the last{under_load(document)}.", "",
             "| system | training again without node 1 | with node 1 back | exit codes | "
             "as its oracle |", "| --- | --- | --- | --- | --- |"]
    for f in document["figures"]:
        same = "bit for bit" if f["max_difference_to_oracle"] == 0 else \
            f"differs by up to {f['max_difference_to_oracle']:.1e}"
        lines.append(f"| {f['system']} | {f['shrunk_after_s']:.1f} s ({f['workers_alone']} "
                     f"workers) | {f['grown_after_s']:.1f} s ({f['workers_back']} workers) | "
                     f"{', '.join(map(str, f['exit_codes']))} | {same} |")
    return "\n".join(lines)


def summary(document):
    """README.md's line: how soon each system trains again without the lost
    node and with it back, and whether each ends as its oracle."""
    demo, torch = (next(f for f in document["figures"] if f["system"] == name)
                   for name in ("demo", "torchrun"))

    def ended(f):
        off, codes = f["max_difference_to_oracle"], f["exit_codes"]
        return ("as its oracle, bit for bit" if off == 0 else
                f"off its oracle by up to {off:.0e}") + \
            ("" if set(codes) == {0} else f" (exit codes {', '.join(map(str, codes))})")
    ends = f"each ends {ended(demo)}" if ended(demo) == ended(torch) else \
        f"the demo ends {ended(demo)}, torchrun {ended(torch)}"
    return (f"{measured_by(document)}: node 1 lost, `--nodes 1:2` trained again after "
            f"{demo['shrunk_after_s']:.1f} s (torchrun `--nnodes 1:2`: "
            f"{torch['shrunk_after_s']:.1f} s), and {demo['grown_after_s']:.1f} s after its "
            f"command started again ({torch['grown_after_s']:.1f} s); {ends}.")


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--dataset", default=DEBIAN_FASHION,
                        help="the data set both systems train on (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=OUT, help="folder for the JSON")
    if "--ddp-worker" in sys.argv:  # torchrun's worker: no benchmark's checks
        return ddp_worker(parser.parse_args())
    args = host_arguments(parser, table)
    needed("torch", "pip install torch --index-url https://download.pytorch.org/whl/cpu (its "
                    "CPU build)")
    dataset = os.path.abspath(args.dataset)
    figures = []
    for system in ("demo", "torchrun"):
        figures.append(measure(system, dataset))
        f = figures[-1]
        print(f"  {system}: training again {f['shrunk_after_s']:.1f} s after the loss, "
              f"{f['grown_after_s']:.1f} s after the return; exit codes {f['exit_codes']}, "
              f"the oracle's {f['oracle_exit_codes']}; off the oracle by "
              f"{f['max_difference_to_oracle']:.1e}", flush=True)
    show(record("elastic", args.out, cpu=True, block="elastic.py", lost_at=LOST_AT, alone=ALONE,
                figures=figures), table)


if __name__ == "__main__":
    sys.exit(main())
