"""How the workers of ``dual_mlp.py`` meet and swap weights.

The pieces, each small enough to read in one go (the zmq sockets between
the workers of one machine, ``Peer``, are in ``trainer.py``, with the rest
of what a step calls):

``XlaExchange`` (``--exchange xla``)
    no home-made transport at all: the workers are the processes of one JAX
    job (``jax.distributed``), and the average is a ``pmean`` that XLA runs
    with NCCL between GPUs or gloo between CPUs, inside the compiled step.

``StagedCudaTransport`` (``--staged``)
    the fallback for GPUs that cannot reach each other's memory: the
    weights go down to a mapped file and up again.

The weights of all layers travel as one flat buffer; ``Layout`` says where
each parameter sits in it.  The transports of the lesson (PyCUDA's peer
copies, mapped files on CPUs) are in ``dual_mlp.py``; ``stream_exchange.py``
holds the GPU-ordered variant of the peer-to-peer exchange (``--sync gpu``);
``devices.py`` the devices the buffers live on.
"""
from multi_gpu import flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)
import contextlib
import os
import sys
import threading

import numpy as np

from multi_gpu import files
from multi_gpu.worker import quit_now


class Layout:
    """Where each parameter lives in the flat exchange buffer: one after
    another, each starting at a multiple of ``align`` elements (``aligned``:
    64 bytes, where JAX on a CPU reads an array in place)."""

    def __init__(self, shapes, dtype, align=1):
        self.shapes, self.dtype = [tuple(s) for s in shapes], np.dtype(dtype)
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(-(-(self.offsets[-1] + n) // align) * align)
        self.size = self.offsets[-1]
        self.nbytes = self.size * self.dtype.itemsize

    def aligned(self):
        """The same parameters, each at a 64-byte boundary."""
        return Layout(self.shapes, self.dtype, align=64 // self.dtype.itemsize)

    @classmethod
    def of(cls, params):
        """The layout of a model's shared parameters."""
        return cls([p.get_value(borrow=True).shape for p in params], params[0].dtype)

    def views(self, flat):
        """The parameters as reshaped slices of a flat buffer."""
        return [flat[a:a + n].reshape(s) for a, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def slots(self, buffers):
        """Each worker's parameters (``views``), in rank order, from flat
        buffers that hold them one after another (a receive buffer holds every
        worker's, a CPU worker's send buffer its own), NumPy or symbolic."""
        return [self.views(flat[w * self.size:(w + 1) * self.size]) for flat in buffers
                for w in range(length(flat) // self.size)]


def length(flat):
    """A flat buffer's number of elements: an array's, or a shared variable's value's."""
    return flat.get_value(borrow=True).size if hasattr(flat, "get_value") else flat.size


class StagedCudaTransport:
    """The fallback for GPUs without peer access (``--staged``): each worker
    copies its weights down into a mapped host file (its name the handle),
    the others copy them up into a receive buffer on their GPU."""

    route = "host memory (staged)"

    def __init__(self, rundir, rank, n_workers, layout, device):
        self.layout, self.device = layout, device
        self.path = os.path.join(rundir, f"weights{rank}.bin")
        self.send = files.mapped(self.path, layout, "new")
        self.send_views = layout.views(self.send)
        self.recv = device.put(np.zeros(n_workers * layout.size, layout.dtype))
        self.received, self.sources = [self.recv], []

    def handle(self):
        return self.path

    def connect(self, handles):
        self.sources = [files.mapped(path, self.layout, "r") for path in handles]

    def publish(self, values):
        for view, value in zip(self.send_views, values):
            self.device.drv.memcpy_dtoh(view, self.device.pointer(value))

    def fetch(self):
        base, nbytes = self.device.pointer(self.recv), self.layout.nbytes
        for w, source in enumerate(self.sources):
            self.device.drv.memcpy_htod(base + w * nbytes, source)

    def close(self):
        self.sources = self.send = self.send_views = None  # unmaps


class XlaExchange:
    """``--exchange xla``: the workers are the processes of one JAX job.

    ``jax.distributed.initialize`` connects every worker to a coordinator,
    which global rank 0 hosts; from then on ``jax.devices()`` lists every
    worker's device, one each, and a program compiled over a mesh of them
    averages with an XLA all-reduce: NCCL between GPUs, gloo between CPUs.
    The runtime's own heartbeats end every process a few seconds after
    ``timeout`` once one has vanished, on whichever machine it ran: this
    worker's watchdog, which names the worker that stopped, speaks first.

    Nothing listens where nobody asked: the coordinator on ``--coordinator``
    only; on one machine gloo's connections on the loopback (NCCL's, by
    ``NCCL_SOCKET_IFNAME=lo``, which the launcher sets); on several, on the
    interfaces named by ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``.
    """

    def __init__(self, coordinator, n_workers, rank, timeout, cpu, one_machine):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        if cpu:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            gloo_on(host="127.0.0.1" if one_machine else None,
                    interface=None if one_machine else os.environ.get("GLOO_SOCKET_IFNAME"))
        # JAX would abort with a stack trace after its own timeout: say why first
        with deadline(timeout, f"worker {rank}: error: the {n_workers} workers did not all "
                               f"meet at the coordinator {coordinator} within {timeout:g} s "
                               "(is every node started, and can it reach that address? "
                               "see --timeout)"):
            jax.distributed.initialize(
                coordinator, num_processes=n_workers, process_id=rank,
                local_device_ids=None if cpu else [0], coordinator_bind_address=coordinator,
                initialization_timeout=int(timeout) + 30,
                heartbeat_timeout_seconds=int(timeout) + 5, shutdown_timeout_seconds=int(timeout))
        self.jax, self.P, self.n = jax, PartitionSpec, n_workers
        self.mesh = Mesh(np.array(jax.devices()), ("workers",))
        self.same_everywhere = NamedSharding(self.mesh, PartitionSpec())

    def replicated(self, local):
        """A global array from this worker's copy of a value all workers hold."""
        return self.jax.make_array_from_single_device_arrays(local.shape, self.same_everywhere,
                                                             [local])

    @staticmethod
    def local(value):
        """This worker's copy of a global array, on its own device."""
        return value.addressable_data(0)

    def mean(self, value):
        """Inside ``program``: the mean over all workers (an XLA all-reduce)."""
        return self.jax.lax.pmean(value, "workers")

    def rank(self):
        """Inside ``program``: this worker's number."""
        return self.jax.lax.axis_index("workers")

    def program(self, call):
        """``call(data, counter, params) -> (counter, params, cost)`` compiled
        as one SPMD program over all workers: ``cost`` is each worker's own
        (shape (1,), only waited on), the rest the same on every worker; the
        counter and the weights are updated in place (donated)."""
        P = self.P
        spmd = self.jax.shard_map(call, mesh=self.mesh, in_specs=(P(), P(), P()),
                                  out_specs=(P(), P(), P("workers")), check_vma=False)
        return self.jax.jit(spmd, donate_argnums=(1, 2))

    def gather(self, host_array):
        """Every worker's ``host_array``, stacked: (n_workers, ...)."""
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(host_array))


def gloo_on(host, interface):
    """Make JAX's CPU client open gloo's sockets on ``host`` or ``interface``
    (JAX passes neither: gloo then takes the address the machine's name
    resolves to, a network interface).  JAX builds the client on the first
    use of a device, after ``jax.distributed.initialize``."""
    from jax._src import xla_bridge
    make = xla_bridge._jax.make_gloo_tcp_collectives

    def where_asked(distributed_client, **_):
        return make(distributed_client=distributed_client, hostname=host, interface=interface)
    xla_bridge._jax.make_gloo_tcp_collectives = where_asked


@contextlib.contextmanager
def deadline(seconds, message):
    """End this process with ``message`` if the block takes longer than
    ``seconds``: for blocking start-up calls that no signal interrupts."""
    def expire():
        print(message, file=sys.stderr, flush=True)
        quit_now(1)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
