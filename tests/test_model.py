"""The tutorial's model, in-process: gradients, and both PyTensor backends."""
import multi_gpu.flags as theano_flags  # first: PyTensor's flags

import contextlib
import shutil
import subprocess
import types

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import mlp
from logistic_sgd import LogisticRegression, load_data, minibatch
from multi_gpu import datasets


@pytest.fixture(scope="module")
def data():
    return load_data(datasets.SHIPPED)


# Each op's NumPy code, no compiler: what the symbolic graph means, at no
# compile cost (a cold Numba compile of a graph used only here took 8-13 s).
# The default mode too, while it runs: an op made of a graph (the softmax's
# OpFromGraph) compiles its inner graph in the default mode, Numba's.
PYTHON = "FAST_COMPILE"


def compiled_by(mode):
    """The block's default mode: ``mode``'s, where it is PYTHON."""
    return pytensor.config.change_flags(mode=mode) if mode == PYTHON else contextlib.nullcontext()


def test_mlp_cost_gradient_matches_finite_differences(data):
    """pytensor.grad of the full cost (NLL + L1 + L2) against central
    differences along random directions, in float64 (biases probed only
    once they are away from L1's kink, as the weights are)."""
    (train_x, train_y) = data[0]
    x_val = train_x.get_value()[:64].astype(np.float64)
    y_val = train_y.get_value()[:64]
    with pytensor.config.change_flags(floatX="float64", mode=PYTHON):
        x, y = pt.matrix("x"), pt.ivector("y")
        model = mlp.MLP(np.random.RandomState(1), x, 784, 20, 10)
        # nonzero output weights, so that every term has a gradient
        model.logRegressionLayer.W.set_value(np.random.RandomState(2).normal(0, 0.1, (20, 10)))
        cost = model.negative_log_likelihood(y) + 0.01 * model.L1 + 0.001 * model.L2_sqr
        grads = pytensor.grad(cost, model.params)
        f = pytensor.function([x, y], [cost] + grads, mode=PYTHON)
        rng = np.random.RandomState(3)
        _, *analytic = f(x_val, y_val)
        start = [p.get_value() for p in model.params]
        for _ in range(3):
            # |w| has a kink at 0: keep the probe from crossing it
            direction = [rng.normal(size=v.shape) * (np.abs(v) > 1e-3) for v in start]
            eps, costs = 1e-6, []
            for sign in (1, -1):
                for p, v, d in zip(model.params, start, direction):
                    p.set_value(v + sign * eps * d)
                costs.append(f(x_val, y_val)[0])
            numeric = (costs[0] - costs[1]) / (2 * eps)
            predicted = sum(float(np.sum(g * d)) for g, d in zip(analytic, direction))
            assert abs(numeric - predicted) <= 1e-6 * max(1.0, abs(predicted))
    # and a wrong gradient would be caught: dropping the L2 term's gradient is
    assert abs(sum(float(np.sum(g * d)) for g, d in zip(analytic[1:], direction[1:]))
               - predicted) > 1e-6


@pytest.mark.parametrize("mode", [PYTHON, "JAX"])
def test_logistic_regression_compiles_and_learns(data, mode):
    """The tutorial's layer, in-process, in plain Python (NumPy per op, no
    compiler) and under JAX; its Numba form learns in test_tutorial_scripts_run_alone."""
    (train_x, train_y), (valid_x, valid_y), _ = data
    index, x, y = pt.lscalar(), pt.matrix("x"), pt.ivector("y")
    clf = LogisticRegression(x, 784, 10)
    cost = clf.negative_log_likelihood(y)
    g_W, g_b = pytensor.grad(cost, [clf.W, clf.b])
    with compiled_by(mode):
        train = pytensor.function([index], cost, mode=mode,
                                  updates=[(clf.W, clf.W - 0.13 * g_W),
                                           (clf.b, clf.b - 0.13 * g_b)],
                                  givens={x: minibatch(train_x, index, 100),
                                          y: minibatch(train_y, index, 100)})
        validate = pytensor.function([], clf.errors(y), mode=mode,
                                     givens={x: valid_x, y: valid_y})
        assert float(validate()) > 0.8  # all-zero weights: one class for everything
        first = float(train(0))
        assert first == pytest.approx(np.log(10), rel=1e-5)  # uniform softmax over 10 classes
        for i in range(30):
            train(i)
        assert float(validate()) < 0.25


def test_the_jax_backend_takes_each_ops_own_first_steps(data):
    """The first two steps (the first moves only the output layer, whose
    weights start at zero; the second moves every parameter) of the JAX
    backend, the CPU's default, are those of each op's own NumPy code (the
    Numba backend's training: test_cpu_workers_compile_with_jax_and_keep_it_numba_one_flag_away)."""
    with compiled_by(PYTHON):
        models = {mode: mlp.Model(data, 100, n_hidden=500, learning_rate=0.13, mode=mode)
                  for mode in (PYTHON, "JAX")}
        for i in range(2):
            costs = {mode: float(m.train_model(i)) for mode, m in models.items()}
            assert costs[PYTHON] == pytest.approx(costs["JAX"], rel=1e-5)
        before = mlp.Model(data, 100, mode=PYTHON).get_params()
        for p_numpy, p_jax, p0 in zip(models[PYTHON].get_params(), models["JAX"].get_params(),
                                      before):
            assert not np.array_equal(p_numpy, p0)
            np.testing.assert_allclose(p_numpy, p_jax, rtol=1e-4, atol=1e-6)
        for f in ("validate_model", "test_model"):  # float64 in one, float32 in the other
            assert float(getattr(models[PYTHON], f)()) == pytest.approx(
                float(getattr(models["JAX"], f)()), rel=1e-6)


def test_theano_flags_are_mapped_onto_pytensor_flags():
    flags, warnings, device = theano_flags.to_pytensor(
        "mode=FAST_RUN,floatX=float64,device=cuda1,lib.cnmem=0.5")
    assert flags == "mode=FAST_RUN,floatX=float64" and device == "cuda1"
    assert len(warnings) == 1 and "lib__cnmem=0.5" in warnings[0]
    assert theano_flags.to_pytensor("device=gpu")[2] == "cuda0"
    assert theano_flags.to_pytensor("device=cpu")[2] is None
    flags, _, _ = theano_flags.to_pytensor("mode=DEBUG_MODE", "optimizer=fast_compile")
    assert flags == "mode=DebugMode,optimizer=fast_compile"
    assert theano_flags.to_pytensor("")[0] == ""
    assert pytensor.config.floatX == "float32"


@contextlib.contextmanager
def jax_compiles():
    """The messages JAX logs while the block runs (a compile says "Compiling")."""
    import logging

    import jax
    messages, handler = [], logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield messages
    finally:
        logging.getLogger("jax").removeHandler(handler)


def test_after_the_warm_up_the_jax_step_does_not_compile_again():
    """Warmed up on NumPy weights and then handed device arrays, JAX compiled
    the step a second time inside the timed loop (seen on the H200s: 0.7 s
    per run, a one-GPU figure eight times too slow)."""
    from multi_gpu.devices import JaxDevice
    device = JaxDevice()
    model = mlp.Model(load_data(datasets.SHIPPED, put=device.put), 20, mode="JAX")
    model.warm_up(put=device.put)
    with jax_compiles() as compiled:
        for i in range(5):
            model.train_model(i)
    assert not [m for m in compiled if "Compiling" in m], compiled


def test_the_warm_up_leaves_the_initial_weights_bit_for_bit():
    """The warm-up's step is undone, bit for bit.  set_params copies, as
    set_value does: it kept the caller's arrays, which a backend that
    updates its weights in place then changed (PyTensor's Python linker:
    training started a step late).  Numba's first epoch against JAX's:
    test_cpu_workers_compile_with_jax_and_keep_it_numba_one_flag_away."""
    model = mlp.Model(load_data(datasets.SHIPPED), 20, mode="JAX")
    before = model.get_params()
    model.warm_up()
    for a, b in zip(before, model.get_params()):
        assert np.array_equal(a, b)


def test_gpu_ordered_step_is_the_tutorial_step_where_the_peer_holds_the_same_weights():
    """The JAX side of ``--sync gpu`` (flat weights, the minibatch picked by a
    counter in the donated state, K steps a call), run on JAX's CPU with an
    exchange that hands back this worker's own new weights, as the mean of
    replicas that all hold them would be: each step must then be PyTensor's
    own SGD step.  The CUDA side runs in the GPU tests."""
    import dual_mlp
    from multi_gpu.devices import JaxDevice

    class EchoExchange:
        callbacks = 0

        def __init__(self, rank, n_workers, layout, rate):
            self.rate = rate

        def __call__(self, params, gradients):
            return [p - self.rate * g for p, g in zip(params, gradients)]

    device = JaxDevice()
    model = mlp.Model(load_data(datasets.SHIPPED, put=device.put), 100, learning_rate=0.1,
                      mode="JAX")
    model.warm_up(put=device.put)
    start = model.get_params()
    no_peer = types.SimpleNamespace(gather=None, barrier=lambda: None)
    trainer = dual_mlp.GpuOrdered(0, 1, model, device, no_peer, check=False, watchdog=None,
                                  steps_per_call=1, exchange=EchoExchange)
    trainer.done = lambda step: True  # no counter in host memory without the CUDA side
    trainer.epoch(5)
    for i in range(5):
        model.train_model(i)
    for mine, theirs in zip(trainer.weights(), model.get_params()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-7)
    assert not np.allclose(trainer.weights()[0], start[0])  # it did train

    # K steps per call: the same steps in the same order, the programs of 4
    # and of the 2 left at the end of an epoch of 30 taking the same minibatches
    model.set_params(start, put=device.put)
    many = dual_mlp.GpuOrdered(0, 1, model, device, no_peer, check=False, watchdog=None,
                               steps_per_call=4, exchange=EchoExchange)
    many.done = trainer.done
    one = dual_mlp.GpuOrdered(0, 1, model, device, no_peer, check=False, watchdog=None,
                              steps_per_call=1, exchange=EchoExchange)
    one.done = trainer.done
    for t in (many, one):
        t.epoch(30)
    assert sorted(many.programs) == [2, 4] and many.calls == 8 and one.calls == 30
    for a, b in zip(many.weights(), one.weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gpu_ordered_programs_are_compiled_before_the_first_epoch():
    """The GPU-ordered trainer compiles its programs ahead (no peer is there
    yet to run them) and then calls them through jit, whose fast dispatch a
    compiled-ahead program with a callback in it does not get: the first
    epoch must find them compiled.  The exchange here is a host callback
    that counts its calls, as the kernels' counter does: once a step."""
    import jax
    from jax.experimental.buffer_callback import buffer_callback

    import dual_mlp
    from multi_gpu.devices import JaxDevice

    class CountingEcho:
        callbacks = 0

        def __init__(self, rank, n_workers, layout, rate):
            self.steps = 0

        def __call__(self, params, gradients):
            return buffer_callback(self.count, [jax.ShapeDtypeStruct(p.shape, p.dtype)
                                                for p in params], has_side_effect=False,
                                   input_output_aliases={i: i for i in range(len(params))})(
                                       *params, *gradients)

        def count(self, ctx, out, *inputs):
            self.steps += 1

        def steps_done(self):
            return self.steps

    device = JaxDevice()
    model = mlp.Model(load_data(datasets.SHIPPED, put=device.put), 100, mode="JAX")
    no_peer = types.SimpleNamespace(gather=None, barrier=lambda: None)
    trainer = dual_mlp.GpuOrdered(0, 1, model, device, no_peer, check=False, watchdog=None,
                                  steps_per_call=4, exchange=CountingEcho)
    with jax_compiles() as compiled:
        trainer.epoch(30)  # calls of 4, and the 2 left at the end
    assert not [m for m in compiled if "Compiling" in m], compiled
    assert trainer.exchange.steps_done() == trainer.steps_run == 30


def test_the_exchange_kernel_cuts_the_weights_into_chunks_every_gpu_shares():
    """Block b of every GPU must handle the same floats, whatever addresses
    XLA gave each GPU's buffers: the chunks follow the layout only.  16-byte
    chunks where a parameter starts on 16 bytes of the flat layout (the
    MLP's four do), single floats where it does not; a short last chunk."""
    from multi_gpu.stream_exchange import WIDTH, Segments, slot_floats

    def plan(sizes, base):
        segments = Segments.of([(base + 1000 * i, n) for i, n in enumerate(sizes)])
        return [(segments.start[i], segments.width[i], segments.chunks_end[i])
                for i in range(segments.count)]

    mlp_sizes = [784 * 500, 500, 500 * 10, 10]
    assert plan(mlp_sizes, 0) == plan(mlp_sizes, 4) == [
        (0, WIDTH, 98000), (392000, WIDTH, 98125), (392500, WIDTH, 99375), (397500, WIDTH, 99378)]
    assert plan([3, 5, 8], 0) == [(0, WIDTH, 1), (3, 1, 6), (8, WIDTH, 8)]
    assert slot_floats(397510) % 32 == 0 and slot_floats(397510) >= 397510


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs CUDA's compiler, nvcc")
def test_the_exchange_kernel_compiles_for_an_h200(tmp_path):
    """The GPU-ordered exchange's kernel source, as the GPU path builds it,
    compiles for the H200 (sm_90) with no stack frame (a struct indexed at
    run time lands in local memory: a version so built ran 4 us a step
    slower): a machine without a GPU catches it before the device does."""
    from multi_gpu.stream_exchange import KERNELS, kernel_options
    built = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-Xptxas", "-v", *kernel_options(),
                            KERNELS, "-o", str(tmp_path / "exchange.cubin")],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    assert "0 bytes stack frame, 0 bytes spill stores" in built.stderr, built.stderr

    # the structs the host mirrors, as this compiler laid them out (what the GPU path
    # reads at load, cuModuleGetGlobal of layouts[]): the mirrors agree, and a field
    # moved on one side alone is named
    from multi_gpu.stream_exchange import mirror_layouts, mirror_problem
    compiled = np.frombuffer(elf_symbol(tmp_path / "exchange.cubin", b"layouts"), np.uint64)
    assert [int(v) for v in compiled] == [v for _, v in mirror_layouts()]
    assert mirror_problem(compiled) is None
    moved = compiled.copy()
    moved[-1] += 4
    assert mirror_problem(moved).startswith("Stamp.step is 48 bytes in ")
    assert "a field added or removed" in mirror_problem(compiled[:-1])


def elf_symbol(path, name):
    """The initial bytes of the global ``name`` in an ELF64 object (a cubin)."""
    import struct
    elf = path.read_bytes()
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    symtab = next(s for s in sections if s[1] == 2)  # SHT_SYMTAB; its sh_link: the names
    names = sections[symtab[6]]
    for at in range(symtab[4], symtab[4] + symtab[5], 24):
        st_name, _, _, st_shndx, st_value, st_size = struct.unpack_from("<IBBHQQ", elf, at)
        if elf[names[4] + st_name:].split(b"\0", 1)[0] == name:
            start = sections[st_shndx][4] + st_value
            return elf[start:start + st_size]
    raise KeyError(name)
