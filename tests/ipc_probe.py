"""One worker of an N-process weight exchange, for test_gpu.py.

    PYTHONPATH=. python tests/ipc_probe.py RANK N RUNDIR GPU [--staged]

Publishes the MLP's parameter shapes filled with this rank's random numbers,
fetches everyone's through the real transport, and exits 0 only if every
value arrived bit for bit (three rounds, the send buffers reused)."""
import sys

import numpy as np

import dual_mlp
import mlp
from multi_gpu.devices import CudaDevice
from multi_gpu.sockets import Peer
from multi_gpu.transports import Layout


def arrays(rank, round_):
    rng = np.random.RandomState(100 * rank + round_)
    return [rng.standard_normal(s).astype(np.float32) for s in mlp.parameter_shapes(784, 500, 10)]


def main():
    rank, n, rundir, gpu = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    device = CudaDevice(gpu)  # started with CUDA_VISIBLE_DEVICES=gpu, as a worker is
    layout = Layout(mlp.parameter_shapes(784, 500, 10), np.float32)
    transport = dual_mlp.transport(device, rundir, rank, n, layout, "--staged" in sys.argv)
    peer = Peer(rundir, rank, n, timeout=60)
    try:
        transport.connect(dual_mlp.swap(peer, transport.handle()))
        for round_ in range(3):
            values = [device.put(a) for a in arrays(rank, round_)]
            device.wait(values)
            transport.publish(values)
            dual_mlp.barrier(peer)
            transport.fetch()
            dual_mlp.barrier(peer)
            got = layout.slots([device.to_host(b) for b in transport.received])
            for worker in range(n):
                for shape, a, b in zip(layout.shapes, got[worker], arrays(worker, round_)):
                    if not np.array_equal(a, b):
                        sys.exit(f"round {round_}: worker {worker}'s parameter of shape {shape} "
                                 "differs")
    finally:
        peer.close()
        transport.close()
        device.close()
    print(f"rank {rank}: {type(transport).__name__} exact for {layout.shapes}")


if __name__ == "__main__":
    main()
