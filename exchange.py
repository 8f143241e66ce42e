"""How the two workers of ``dual_mlp.py`` meet and swap weights.

The pieces, each small enough to read in one go:

``Peer``
    a zmq PAIR socket between the two workers, over ``ipc://`` in the run's
    private directory.  It carries the one-time handshake (each worker's
    buffer handle) and, every step, the barriers: each side sends the step
    number and waits for the other's.  Every wait has a timeout.

``HostDevice`` / ``JaxDevice`` / ``CudaDevice``
    where a worker's arrays live.  On the CPU, PyTensor's default backend
    runs the graph on NumPy arrays (or, for ``--exchange xla``, its JAX
    backend on JAX's CPU device).  On a GPU, PyTensor's JAX backend runs it
    on ``jax.Array`` buffers of that GPU, and PyCUDA works on the same memory
    through the device's primary context, the one JAX uses too.

the transports
    a worker *publishes* its weights into its own send buffer, whose address
    never moves, and the peer *fetches* them from there into its receive
    buffer:

    * ``HostTransport`` (CPU): the send buffer is a file in the run's private
      directory that both workers map; its path is the handle.
    * ``CudaIpcTransport`` (GPU): the send buffer is PyCUDA device memory; its
      CUDA IPC handle goes to the peer once, and every fetch is one
      device-to-device copy from the peer's GPU (over NVLink where there is one).
    * ``StagedCudaTransport`` (GPU pairs that cannot reach each other's
      memory): device -> mapped host file -> device.

``XlaExchange`` (``--exchange xla``)
    no home-made transport at all: the workers are the processes of one JAX
    job (``jax.distributed``), and the average is a ``pmean`` that XLA runs
    with NCCL between GPUs or gloo between CPUs, inside the compiled step.

The weights of all layers travel as one flat buffer; ``Layout`` says where
each parameter sits in it.  (``stream_exchange.py`` holds the GPU-ordered
variant of the peer-to-peer exchange.)
"""
import contextlib
import os
import pickle
import platform
import shutil
import struct
import sys
import threading
import time
import warnings

import numpy as np
import zmq


class PeerError(Exception):
    """The other worker stalled, vanished or disagreed; one line of message."""


class Interrupted(Exception):
    """This worker was asked to stop (SIGINT or SIGTERM) while it waited."""


class StopRequest:
    """Set by SIGINT (Ctrl-C) or SIGTERM (the launcher stopping us, or Linux
    when the launcher dies).  A worker stops at the next step or while it
    waits for its peer, never inside a compiled call or a checkpoint write.
    A plain attribute, not a threading.Event: a signal handler must take no
    lock, or a second signal arriving inside it deadlocks the process."""

    signum = 0

    def is_set(self):
        return self.signum != 0


stopping = StopRequest()


def request_stop(signum, frame):
    stopping.signum = signum


class Peer:
    """The zmq link to the other worker: worker 0 binds, worker 1 connects."""

    def __init__(self, rundir, rank, timeout, stopping, spin=0.0):
        """
        :param timeout: seconds to wait for the peer at any barrier
        :param stopping: has is_set(); once it is set, any wait ends
        :param spin: seconds to poll without sleeping before blocking; a
            wake-up from a blocking wait costs tens of microseconds, which
            matters next to a GPU step but would steal a CPU worker's core
        """
        self.rank, self.timeout, self.stopping, self.spin = rank, timeout, stopping, spin
        self.barriers = 0
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        address = "ipc://" + os.path.join(rundir, "peer.sock")
        if rank == 0:
            self.socket.bind(address)
        else:
            self.socket.connect(address)

    def _wait(self, event, what):
        """Wait, in slices, until the socket can send or receive (``event``);
        a stop request or the timeout ends the wait.  (A PAIR socket whose
        peer is gone blocks a plain send forever.)"""
        deadline = time.monotonic() + self.timeout
        while not self.socket.poll(100, event):
            if self.stopping.is_set():
                raise Interrupted
            if time.monotonic() > deadline:
                raise PeerError(f"worker {1 - self.rank} did not reach {what} within "
                                f"{self.timeout:g} s (see --timeout)")

    def _send(self, message, what):
        self._wait(zmq.POLLOUT, what)
        self.socket.send(message, zmq.NOBLOCK)

    def _recv(self, what):
        deadline = time.perf_counter() + self.spin
        while time.perf_counter() < deadline:
            try:
                return self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                pass
        self._wait(zmq.POLLIN, what)
        return self.socket.recv(zmq.NOBLOCK)

    def exchange(self, obj, what="the handshake"):
        """Send ``obj``, return the peer's (the handles, once; --check)."""
        self._send(pickle.dumps(obj), what)
        return pickle.loads(self._recv(what))

    def gather(self, array):
        """Both workers' ``array``, stacked, mine first (for --check)."""
        return np.stack([array, self.exchange(array, "the replica check")])

    def barrier(self):
        """Return once both workers have called it as often as each other,
        with the seconds spent waiting because the peer arrived later (both
        stamp their arrival on the machine-wide monotonic clock)."""
        self.barriers += 1
        arrived = time.perf_counter()
        what = f"barrier {self.barriers}"
        self._send(struct.pack("<qd", self.barriers, arrived), what)
        count, peer_arrived = struct.unpack("<qd", self._recv(what))
        if count != self.barriers:
            raise PeerError(f"workers out of step: at barrier {self.barriers}, "
                            f"the peer is at {count}")
        return max(0.0, peer_arrived - arrived)

    def close(self):
        # Linger a moment: a message still in flight (the last --check
        # exchange, 1.6 MB) is discarded by a close without it, and the peer
        # then waits for it until its timeout.
        self.socket.close(linger=1000)
        self.context.term()


class Layout:
    """Where each parameter lives in the flat exchange buffer."""

    def __init__(self, shapes, dtype):
        self.shapes, self.dtype = [tuple(s) for s in shapes], np.dtype(dtype)
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int).tolist()
        self.size = self.offsets[-1]
        self.nbytes = self.size * self.dtype.itemsize

    def views(self, flat):
        """The parameters as reshaped slices of a flat buffer."""
        return [flat[a:a + n].reshape(s) for a, n, s in zip(self.offsets, self.sizes, self.shapes)]


class HostDevice:
    """A worker on the CPU: PyTensor's default backend, NumPy arrays."""

    name = "cpu"
    mode = None  # the mode of PYTENSOR_FLAGS / THEANO_FLAGS
    spin = 0.0
    description = platform.processor() or platform.machine()

    def put(self, array):
        return np.array(array)

    def to_host(self, value):
        return np.asarray(value)

    def wait(self, values):
        pass  # NumPy work is done when the call returns

    def average_in_place(self, arrays, recv, layout):
        """``--avg pycuda`` on the CPU: the direct array operation, in place."""
        for mine, theirs in zip(arrays, layout.views(recv)):
            np.add(mine, theirs, out=mine)
            mine *= 0.5

    def transport(self, rundir, rank, layout, staged):
        return HostTransport(rundir, rank, layout, self)

    def close(self):
        pass


class JaxDevice:
    """A worker whose graph PyTensor compiles with its JAX backend, on the one
    JAX device this process sees (its GPU, or the CPU for ``--exchange xla``
    on CPUs)."""

    mode = "JAX"
    spin = 0.0

    def __init__(self):
        import jax
        self.jax = jax
        # PyTensor's JAX backend drops shape assertions and float64 casts (JAX
        # runs 32-bit); it says so once per compiled graph, harmlessly
        warnings.filterwarnings("ignore", "Skipping Assert")
        warnings.filterwarnings("ignore", "Explicitly requested dtype")
        # full float32 matrix products (JAX may otherwise round them to TF32),
        # so that the GPU path follows the CPU path's numbers
        jax.config.update("jax_default_matmul_precision", "highest")
        (self.jax_device,) = jax.local_devices()  # creates JAX's context on our GPU
        self.name = f"{self.jax_device.platform}{self.jax_device.id}"
        self.description = self.jax_device.device_kind

    def put(self, array):
        return self.jax.device_put(np.asarray(array), self.jax_device)

    def to_host(self, value):
        return np.array(value)

    def wait(self, values):
        self.jax.block_until_ready(values)

    def close(self):
        pass


class CudaDevice(JaxDevice):
    """A worker bound to one GPU.

    The launcher started this process with ``CUDA_VISIBLE_DEVICES`` naming
    only its GPU, so JAX and PyCUDA both see it as device 0 and this process
    takes no memory on any other GPU.  (A CUDA IPC handle still opens memory
    of a GPU the process cannot see.)  PyCUDA retains the device's primary
    context, the one JAX uses: pointers from JAX arrays are valid in PyCUDA,
    and the reverse.
    """

    spin = 0.002

    def __init__(self, index):
        super().__init__()
        import pycuda.driver as drv
        from pycuda.compiler import SourceModule

        self.drv, self.name = drv, f"cuda{index}"
        drv.init()
        self.description = drv.Device(0).name()
        self.context = drv.Device(0).retain_primary_context()
        self.context.push()
        self.stream = drv.Stream()
        # One small kernel, launched once per parameter: mine = (mine + peer) / 2.
        self._average = SourceModule(nvcc=nvcc(), source="""
            __global__ void average(float *mine, const float *peer, unsigned n) {
                for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
                     i += blockDim.x * gridDim.x)
                    mine[i] = 0.5f * (mine[i] + peer[i]);
            }""").get_function("average")
        self._average.prepare("PPI")

    def to_host(self, value):
        """A fresh host copy.  Not np.asarray: a jax.Array caches its first host
        copy, and PyCUDA writes the receive buffer behind JAX's back."""
        self.jax.block_until_ready(value)
        host = np.empty(value.shape, value.dtype)
        self.drv.memcpy_dtoh(host, self.pointer(value))
        return host

    @staticmethod
    def pointer(array):
        return array.unsafe_buffer_pointer()

    def average_in_place(self, arrays, recv, layout):
        """``--avg pycuda``: the kernel, in place on the buffers JAX handed
        back; safe because nothing else holds them and we wait for it."""
        base, itemsize = self.pointer(recv), layout.dtype.itemsize
        for mine, offset in zip(arrays, layout.offsets):
            n = mine.size
            self._average.prepared_async_call((min((n + 255) // 256, 1024), 1), (256, 1, 1),
                                              self.stream, self.pointer(mine),
                                              base + offset * itemsize, np.uint32(n))
        self.stream.synchronize()

    def transport(self, rundir, rank, layout, staged):
        """Peer to peer, or ``staged`` through host memory: the launcher
        chooses, by whether the two GPUs can reach each other's memory."""
        if staged:
            return StagedCudaTransport(rundir, rank, layout, self)
        return CudaIpcTransport(layout, self)

    def close(self):
        self.context.pop()
        self.context.detach()


def nvcc():
    """The CUDA compiler PyCUDA builds the kernels with."""
    return shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


class HostTransport:
    """CPU weights through host memory: a file in the run directory, mapped
    by both workers, stands in for a CUDA IPC buffer; its path is the handle."""

    route = "host memory"

    def __init__(self, rundir, rank, layout, device):
        self.layout, self.device = layout, device
        self.path = os.path.join(rundir, f"weights{rank}.bin")
        self.send = np.memmap(self.path, layout.dtype, mode="w+", shape=(layout.size,))
        self.send_views = layout.views(self.send)
        self.recv = device.put(np.zeros(layout.size, layout.dtype))
        self.peer = None

    def handle(self):
        return self.path

    def connect(self, handle):
        self.peer = np.memmap(handle, self.layout.dtype, mode="r", shape=(self.layout.size,))

    def publish(self, values):
        for view, value in zip(self.send_views, values):
            view[...] = value

    def fetch(self):
        self.recv[...] = self.peer

    def close(self):
        self.peer = self.send = self.send_views = None  # unmaps


class CudaIpcTransport:
    """GPU to GPU.  The send buffer is allocated once by PyCUDA, so its
    address never moves (JAX writes every step's weights to new buffers)
    and one IPC handle serves the whole run.  The receive buffer is a JAX
    array, so the compiled averaging function can read it directly."""

    route = "CUDA IPC, peer to peer"

    def __init__(self, layout, device):
        self.layout, self.device = layout, device
        drv = device.drv
        self.send = drv.mem_alloc(layout.nbytes)
        self.recv = device.put(np.zeros(layout.size, layout.dtype))
        self.peer = None

    def handle(self):
        return self.device.drv.mem_get_ipc_handle(self.send)

    def connect(self, handle):
        # maps the peer's buffer into our context; peer access is enabled lazily
        self.peer = self.device.drv.IPCMemoryHandle(handle)

    def publish(self, values):
        drv, stream, itemsize = self.device.drv, self.device.stream, self.layout.dtype.itemsize
        for offset, value in zip(self.layout.offsets, values):
            drv.memcpy_dtod_async(int(self.send) + offset * itemsize, self.device.pointer(value),
                                  value.nbytes, stream)
        stream.synchronize()

    def fetch(self):
        self.device.drv.memcpy_dtod_async(self.device.pointer(self.recv), self.peer,
                                          self.layout.nbytes, self.device.stream)
        self.device.stream.synchronize()

    def close(self):
        if self.peer is not None:
            self.peer.close()
        self.send.free()
        self.peer = None


class StagedCudaTransport(HostTransport):
    """The fallback for two GPUs without peer access: each worker copies its
    weights down into its mapped host file, the peer copies them up."""

    route = "host memory (staged)"

    def publish(self, values):
        for view, value in zip(self.send_views, values):
            self.device.drv.memcpy_dtoh(view, self.device.pointer(value))

    def fetch(self):
        self.device.drv.memcpy_htod(self.device.pointer(self.recv), self.peer)


class XlaExchange:
    """``--exchange xla``: the workers are the processes of one JAX job.

    ``jax.distributed.initialize`` connects every worker to a coordinator,
    which global rank 0 hosts; from then on ``jax.devices()`` lists every
    worker's device, one each, and a program compiled over a mesh of them
    averages with an XLA all-reduce: NCCL between GPUs, gloo between CPUs.
    The runtime's own heartbeats end every process within ``HEARTBEAT``
    seconds of one vanishing, on whichever machine it ran.
    """

    HEARTBEAT = 10  # seconds

    def __init__(self, coordinator, n_workers, rank, timeout, cpu):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        if cpu:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX would abort with a stack trace after its own timeout: say why first
        with deadline(timeout, f"worker {rank}: error: the {n_workers} workers did not all "
                               f"meet at the coordinator {coordinator} within {timeout:g} s "
                               "(is every node started, and can it reach that address? "
                               "see --timeout)"):
            jax.distributed.initialize(
                coordinator, num_processes=n_workers, process_id=rank,
                local_device_ids=None if cpu else [0], coordinator_bind_address=coordinator,
                initialization_timeout=int(timeout) + 30, heartbeat_timeout_seconds=self.HEARTBEAT,
                shutdown_timeout_seconds=int(timeout))
        self.jax, self.P, self.n = jax, PartitionSpec, n_workers
        self.mesh = Mesh(np.array(jax.devices()), ("workers",))
        self.same_everywhere = NamedSharding(self.mesh, PartitionSpec())
        self.one_each = NamedSharding(self.mesh, PartitionSpec("workers"))

    def replicated(self, local):
        """A global array from this worker's copy of a value all workers hold."""
        return self.jax.make_array_from_single_device_arrays(local.shape, self.same_everywhere,
                                                             [local])

    def per_worker(self, local):
        """A global (n_workers, ...) array whose row k is worker k's ``local`` (1, ...)."""
        return self.jax.make_array_from_single_device_arrays((self.n,) + local.shape[1:],
                                                             self.one_each, [local])

    @staticmethod
    def local(value):
        """This worker's copy of a global array, on its own device."""
        return value.addressable_data(0)

    def mean(self, value):
        """Inside ``program``: the mean over all workers (an XLA all-reduce)."""
        return self.jax.lax.pmean(value, "workers")

    def program(self, step):
        """``step(index, data, params) -> (cost, state)`` compiled as one SPMD
        program over all workers: ``index`` and ``cost`` (each worker's own,
        shape (1,), only waited on) are per worker, the rest is the same on
        every worker."""
        P = self.P
        spmd = self.jax.shard_map(step, mesh=self.mesh, in_specs=(P("workers"), P(), P()),
                                  out_specs=(P("workers"), P()), check_vma=False)
        return self.jax.jit(spmd, donate_argnums=2)  # the weights: updated in place

    def gather(self, host_array):
        """Every worker's ``host_array``, stacked: (n_workers, ...)."""
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(host_array))


@contextlib.contextmanager
def deadline(seconds, message):
    """End this process with ``message`` if the block takes longer than
    ``seconds``: for blocking start-up calls that no signal interrupts."""
    def expire():
        print(message, file=sys.stderr, flush=True)
        os._exit(1)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
