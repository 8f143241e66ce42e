"""A multilayer perceptron in PyTensor: the deeplearning.net tutorial's MLP.

A multilayer perceptron is a logistic regressor where, instead of feeding
the input to the logistic regression, you insert an intermediate layer, the
hidden layer, that has a nonlinear activation function (here tanh).  The
logistic regression's input is the hidden layer's output:

.. math::

    f(x) = G( b^{(2)} + W^{(2)}( s( b^{(1)} + W^{(1)} x)))

with shapes, for MNIST and 500 hidden units: ``x`` (n_examples, 784),
``W1`` (784, 500), ``b1`` (500,), ``W2`` (500, 10), ``b2`` (10,).  That is
397,510 parameters, 1.59 MB in float32.

Run alone, this file trains one model on one process, as the tutorial did::

    python mlp.py [--dataset PATH] [--epochs 10] [--batch-size 20] [--save model.npz]
    THEANO_FLAGS=device=cuda0 python mlp.py      # on GPU 0, through PyTensor's JAX backend
    THEANO_FLAGS=mode=NUMBA python mlp.py        # on the CPU through Numba, not JAX
"""
import signal
import sys

if __name__ == "__main__":  # a Ctrl-C while PyTensor loads ends the script, with no traceback
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.path.insert(0, __file__.rpartition("/")[0])  # the package, under python -I too
import multi_gpu.tutorial as tutorial  # first: THEANO_FLAGS onto PyTensor's flags; data; options

import functools
import shlex
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

from logistic_sgd import LogisticRegression, load_data, minibatch


class HiddenLayer:
    def __init__(self, rng, input, n_in, n_out, W=None, b=None, activation=pt.tanh):
        """A fully connected layer: ``output = activation(dot(input, W) + b)``.

        :param rng: numpy.random.RandomState used to initialise the weights
        :param input: symbolic matrix of shape (n_examples, n_in)
        :param n_in: dimensionality of the input
        :param n_out: number of hidden units
        :param activation: nonlinearity of the hidden layer

        ``W`` (n_in, n_out) is drawn uniformly from
        :math:`\\pm\\sqrt{6 / (n_{in} + n_{out})}` (Glorot & Bengio, 2010, for
        tanh; four times that for the sigmoid); ``b`` (n_out,) starts at 0.
        """
        self.input = input
        floatX = pytensor.config.floatX
        if W is None:
            bound = np.sqrt(6.0 / (n_in + n_out))
            W_values = np.asarray(rng.uniform(low=-bound, high=bound, size=(n_in, n_out)),
                                  dtype=floatX)
            if activation == pt.sigmoid:
                W_values *= 4
            W = pytensor.shared(value=W_values, name="W", borrow=True)
        if b is None:
            b = pytensor.shared(value=np.zeros((n_out,), dtype=floatX), name="b", borrow=True)
        self.W, self.b = W, b

        lin_output = pt.dot(input, self.W) + self.b
        self.output = lin_output if activation is None else activation(lin_output)
        self.params = [self.W, self.b]


class MLP:
    """One hidden layer of tanh units under a softmax (LogisticRegression)
    output layer, with the L1 and squared L2 norms of the weights for
    regularisation."""

    def __init__(self, rng, input, n_in, n_hidden, n_out):
        self.hiddenLayer = HiddenLayer(rng=rng, input=input, n_in=n_in, n_out=n_hidden,
                                       activation=pt.tanh)
        self.logRegressionLayer = LogisticRegression(input=self.hiddenLayer.output,
                                                     n_in=n_hidden, n_out=n_out)
        self.L1 = abs(self.hiddenLayer.W).sum() + abs(self.logRegressionLayer.W).sum()
        self.L2_sqr = (self.hiddenLayer.W ** 2).sum() + (self.logRegressionLayer.W ** 2).sum()
        self.negative_log_likelihood = self.logRegressionLayer.negative_log_likelihood
        self.errors = self.logRegressionLayer.errors
        self.params = self.hiddenLayer.params + self.logRegressionLayer.params
        self.input = input


class Model:
    """An MLP and its three compiled functions, as the tutorial builds them:

    * ``train_model(i)``: one SGD step on minibatch ``i``, returns the cost
      ``NLL + L1_reg * L1 + L2_reg * L2_sqr``;
    * ``validate_model()``, ``test_model()``: error rate on the whole
      validation or test set (None where the model ``evaluates`` nothing:
      a worker that never validates compiles only its step);
    * ``gradient_model(i)``, compiled when first used: the same step
      without its update, returning the cost and the gradients, for a
      trainer that applies ``param - learning_rate * gradient`` itself
      (``dual_mlp.py --sync gpu``: the exchange kernel, as it publishes).
    """

    def __init__(self, data, batch_size, n_hidden=500, learning_rate=0.01, L1_reg=0.0,
                 L2_reg=0.0001, seed=1234, mode=None, evaluates=True):
        """
        :param data: the shared ``[(train_x, train_y), (valid_x, valid_y), (test_x, test_y)]``
        :param mode: PyTensor mode for every function (None: the flags' mode, "JAX": JAX)
        :param evaluates: compile ``validate_model`` and ``test_model`` too
        """
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = data
        self.n_train_batches = train_x.get_value(borrow=True).shape[0] // batch_size

        index = pt.lscalar("index")
        x = pt.matrix("x")
        y = pt.ivector("y")
        self.classifier = classifier = MLP(rng=np.random.RandomState(seed), input=x,
                                           n_in=tutorial.N_PIXELS, n_hidden=n_hidden,
                                           n_out=tutorial.N_CLASSES)
        self.params = classifier.params
        cost = (classifier.negative_log_likelihood(y) + L1_reg * classifier.L1
                + L2_reg * classifier.L2_sqr)
        gparams = [pytensor.grad(cost, param) for param in classifier.params]
        updates = [(param, param - learning_rate * gparam)
                   for param, gparam in zip(classifier.params, gparams)]

        givens = {x: minibatch(train_x, index, batch_size),
                  y: minibatch(train_y, index, batch_size)}
        self.train_model = pytensor.function([index], cost, updates=updates, mode=mode,
                                             givens=givens)
        self.learning_rate = learning_rate
        self._gradients = dict(inputs=[index], outputs=[cost, *gparams], givens=givens, mode=mode)
        self.validate_model = self.test_model = None
        if evaluates:
            self.validate_model = pytensor.function([], classifier.errors(y), mode=mode,
                                                    givens={x: valid_x, y: valid_y})
            self.test_model = pytensor.function([], classifier.errors(y), mode=mode,
                                                givens={x: test_x, y: test_y})

    @functools.cached_property
    def gradient_model(self):
        return pytensor.function(**self._gradients)

    def get_params(self):
        return [np.array(p.get_value()) for p in self.params]

    def set_params(self, values, put=np.asarray):
        """Set the weights to copies of ``values`` (as ``set_value`` does: a
        backend that updates its weights in place must not change the
        caller's); ``put`` places each where the backend computes
        (``jax.device_put`` for a GPU), so it stays there."""
        for p, v in zip(self.params, values):
            p.container.storage[0] = put(np.array(v, dtype=p.dtype))

    def warm_up(self, *more, put=np.asarray):
        """Call every compiled function once (and ``more``), then put the
        weights back: the Numba and JAX backends compile on the first call,
        which must not land inside a timed step.  The weights are placed
        with ``put`` first: JAX compiles anew for arrays that live elsewhere
        (NumPy then device arrays cost a second compile, in the loop)."""
        saved = self.get_params()
        self.set_params(saved, put)
        self.train_model(0)
        for f in (self.validate_model, self.test_model, *more):
            if f is not None:
                f()
        self.set_params(saved, put)


def parameter_shapes(n_in, n_hidden, n_out):
    """The shapes of ``MLP.params``: W and b of each layer."""
    return [(n_in, n_hidden), (n_hidden,), (n_hidden, n_out), (n_out,)]


def test_mlp(learning_rate=0.01, L1_reg=0.00, L2_reg=0.0001, n_epochs=10, dataset=None,
             batch_size=20, n_hidden=500, seed=1234, save=None, json_path=None, device=None):
    """Stochastic gradient descent on the MLP, the tutorial's demonstration
    reduced to its core loop: train on every minibatch, validate after each
    epoch, keep the test error of the best-validation model.

    :param device: a ``multi_gpu.devices.JaxDevice`` (the CPU, or a GPU:
        ``THEANO_FLAGS=device=cuda0``), or None for the CPU with the mode the
        flags name (``THEANO_FLAGS=mode=NUMBA``)
    """
    dataset, notice = tutorial.resolve(dataset)
    if notice:
        print(notice)
    mode, put = (device.mode, device.put) if device else (None, np.asarray)
    data = load_data(dataset, put=put if device else None)
    n_train = data[0][0].get_value(borrow=True).shape[0]
    if n_train < batch_size:
        raise tutorial.DatasetError(f"batch size {batch_size} is larger than the training set "
                                    f"({n_train} images)")
    with tutorial.heartbeat(tutorial.compiling("the model", mode, device.name if device else
                                               "cpu")):
        model = Model(data, batch_size, n_hidden, learning_rate, L1_reg, L2_reg, seed, mode=mode)
        model.warm_up(put=put)
    n_train_batches = model.n_train_batches

    print("... training")
    best_validation_loss, test_score, best_params = np.inf, np.inf, model.get_params()
    validation_losses, train_time, curve = [], 0.0, []
    for epoch in range(1, n_epochs + 1):
        start = time.perf_counter()
        for minibatch_index in range(n_train_batches):
            cost = model.train_model(minibatch_index)
        float(cost)  # the epoch's steps are done (a JAX device runs behind the host)
        train_time += time.perf_counter() - start
        tutorial.check_finite(model.get_params(), epoch, learning_rate, L1_reg, L2_reg,
                              kept="--save's file, if any, is left as it was")
        this_validation_loss = float(model.validate_model())
        validation_losses.append(this_validation_loss)
        print(f"epoch {epoch}, minibatch {n_train_batches}/{n_train_batches}, "
              f"validation error {this_validation_loss * 100.:f} %")
        if this_validation_loss < best_validation_loss:
            best_validation_loss = this_validation_loss
            test_score = float(model.test_model())
            best_params = model.get_params()
        curve.append(tutorial.epoch_record(epoch, train_time, this_validation_loss, test_score))
    samples_per_s = n_epochs * n_train_batches * batch_size / train_time
    print(f"Optimization complete. Best validation score of {best_validation_loss * 100.:f} % "
          f"with test performance {test_score * 100.:f} %")
    print(f"The code ran for {n_epochs / train_time:.2f} epochs/s of training "
          f"({samples_per_s:,.0f} samples/s, {1e6 * train_time / n_epochs / n_train_batches:.0f} "
          "us per step; the compile and the validation not counted)")
    if json_path:
        summary = dict(
            tutorial.run_header(shlex.join(["python", "mlp.py"] + sys.argv[1:])),
            device=device.description if device else "cpu",
            backend=tutorial.backend_name(mode), batch_size=batch_size,
            epochs_run=n_epochs, steps_per_epoch=n_train_batches, training_time_s=train_time,
            samples_per_s=samples_per_s,
            step_us=dict(step=1e6 * train_time / n_epochs / n_train_batches),
            validation_errors=validation_losses, best_validation_error=best_validation_loss,
            test_error=test_score, curve=curve)
        tutorial.write_json_or_show(json_path, summary, "mlp.py")
    if save:  # after the summary: a save that fails loses no figure
        tutorial.save_checkpoint(save, model.get_params(), best_params, epoch=n_epochs,
                                best_validation_error=best_validation_loss,
                                test_error=test_score)
    return best_validation_loss, test_score


def main(argv=None):
    tutorial.quiet_start_up()
    parser = tutorial.parser("Train the tutorial's MLP on one process (on a GPU with "
                             "THEANO_FLAGS=device=cuda0).", epochs=10, batch_size=20,
                             learning_rate=0.01)
    tutorial.add_model_options(parser, n_hidden=500, l1=0.0, l2=0.0001, weights_seed=1234)
    parser.add_argument("--save", metavar="PATH", type=tutorial.writable,
                        help="write the final model (.npz) here")
    parser.add_argument("--json", metavar="PATH", type=tutorial.writable,
                        help="write a summary (timings, errors) as JSON")
    args = parser.parse_args(argv)
    return tutorial.run("mlp.py", lambda: test_mlp(
        args.learning_rate, args.l1, args.l2, args.epochs, args.dataset, args.batch_size,
        args.n_hidden, args.seed, args.save, args.json, tutorial.device_from_flags()),
        args.dataset, {"--save": args.save, "--json": args.json},
        parameter_shapes(tutorial.N_PIXELS, args.n_hidden, tutorial.N_CLASSES))


if __name__ == "__main__":
    sys.exit(main())
