"""``--exchange xla``: the workers as the processes of one JAX job.

No home-made transport at all: the workers meet through JAX's distributed
runtime (``jax.distributed``), and the average is a ``pmean`` that XLA runs
with NCCL between GPUs or gloo between CPUs, inside the compiled step.
Several machines, or GPUs past two.  ``XlaExchange`` starts the runtime
and compiles over it; ``XlaOrdered`` is ``dual_mlp.py``'s step inside it.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import sys
import threading

import numpy as np

from multi_gpu import devices
from multi_gpu.devices import storage
from multi_gpu.sockets import PeerError
from multi_gpu.trainer import DeviceOrdered, local_sgd, minibatch
from multi_gpu.worker import quit_now

# jaxlib releases whose all-reduce between CPU processes (gloo) hangs in the step's first
# call: the same compiled step (saved by jax.export) runs on the release before, 0.12.0.1
HANGING_CPU_ALL_REDUCE = {"0.12.1"}


def jax_problem(cpu):
    """Why the JAX installed cannot run ``--exchange xla`` (on CPUs: ``cpu``),
    in one line; None where it can."""
    if importlib.util.find_spec("jax") is None:
        return "--exchange xla needs JAX: pip install jax"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # built from source
        jaxlib = importlib.metadata.version("jaxlib")
        if cpu and jaxlib in HANGING_CPU_ALL_REDUCE:
            return (f"--exchange xla on CPUs: jaxlib {jaxlib}'s all-reduce between CPU processes "
                    f"(gloo) hangs in the step's first call: pip install 'jax[cpu]<0.12.1' "
                    "(as requirements.txt asks)")
    return None


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
        self.jax, self.P, self.n, self.timeout = jax, PartitionSpec, n_workers, timeout
        self.mesh = Mesh(np.array(jax.devices()), ("workers",))
        self.same_everywhere = NamedSharding(self.mesh, PartitionSpec())

    def meet(self, what):
        """Wait for every worker at a barrier of JAX's coordinator, for at
        most --timeout (PeerError), not at the first collective: gloo's own
        rendezvous gives up after 30 s, in a stack trace, on a worker still
        compiling on a busy machine, or stopped there a while."""
        from jax._src import distributed
        try:
            distributed.global_state.client.wait_at_barrier(f"dual_mlp {what}",
                                                             int(self.timeout * 1000))
        except self.jax.errors.JaxRuntimeError:
            raise PeerError(f"the {self.n} workers did not all get {what} within "
                            f"{self.timeout:g} s (a worker stopped, or a machine that slow? "
                            "see --timeout)") from None

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


class XlaOrdered(DeviceOrdered):
    """``--exchange xla``: the mean as an XLA all-reduce inside the step, run by
    JAX's distributed runtime (NCCL, or gloo on CPUs): several machines, or GPUs past two."""

    route = "an XLA all-reduce (JAX's distributed runtime)"

    def __init__(self, rank, world, model, device, xla, *, check, watchdog, steps_per_call,
                 average_every=1):
        super().__init__(rank, world, model, gather=xla.gather, check=check, watchdog=watchdog,
                         steps_per_call=steps_per_call, average_every=average_every)
        model.warm_up(put=device.put)
        train, data = devices.jax_train_step(model)

        def step(data, counter, params, cost, average=True):
            index = minibatch(counter, xla.rank(), world, self.n_steps)  # this worker's minibatch
            cost, new = train(index, data, params)                       # 1. train
            if average:                                                  # 2.-6. all-reduce
                new = [xla.mean(p) for p in new]
            return counter + 1, new, cost[None]

        self.one_step, self.xla = step, xla
        self.own_step = functools.partial(step, average=False)  # local SGD: no all-reduce
        self.data = [xla.replicated(d) for d in data]
        self.state = (xla.replicated(device.put(np.int32(0))),
                      [xla.replicated(storage(p)) for p in model.params])
        self.compile()

    def handshake(self):
        self.xla.meet("to their first step")

    def program(self, steps):
        import jax.numpy as jnp
        loop = local_sgd(self.own_step, self.one_step, steps, self.average_every)

        def call(data, counter, params):  # the marker: each worker's cost of the last step
            return loop(data, counter, params, jnp.zeros(1, params[0].dtype))
        return self.xla.program(call).lower(self.data, *self.state).compile()

    def queue(self, steps):
        *self.state, cost = self.programs[steps](self.data, *self.state)
        return cost

    def done(self, cost):  # ready, and raises where its all-reduce lost a worker (a node gone)
        return cost.is_ready() and cost.block_until_ready() is not None

    def device_weights(self):
        return [self.xla.local(p) for p in self.state[1]]

    def finish(self):
        self.exchange_steps = int(np.asarray(self.xla.local(self.state[0])))


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
