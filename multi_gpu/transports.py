"""The weights' flat buffer, and the transport the lesson does not hold.

The weights of all layers travel as one flat buffer; ``Layout`` says where
each parameter sits in it.  ``StagedCudaTransport`` (``--staged``) is the
fallback for GPUs that cannot reach each other's memory: the weights go
down to a mapped file and up again.  The lesson's own transports (PyCUDA's
peer copies, mapped files on CPUs) are in ``dual_mlp.py``;
``stream_exchange.py`` holds the GPU-ordered exchange (``--sync gpu``),
``xla_runtime.py`` the exchange inside XLA (``--exchange xla``).
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import os

import numpy as np

from multi_gpu import files


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
