"""Logistic regression with stochastic gradient descent, in PyTensor.

A port of the deeplearning.net tutorial module of the same name (the
Theano tutorial that ``dual_mlp.py``'s 2014 original was built on).

Logistic regression is a probabilistic, linear classifier, parametrised by a
weight matrix :math:`W` and a bias vector :math:`b`.  It projects an input
vector onto a set of hyperplanes, one per class; the distance to a
hyperplane gives the probability of its class:

.. math::

    P(Y=i|x, W,b) = softmax_i(W x + b) = \\frac {e^{W_i x + b_i}} {\\sum_j e^{W_j x + b_j}}

and the prediction is the most probable class:

.. math::

    y_{pred} = argmax_i P(Y=i|x,W,b)

Run alone, this file trains the model on the demo's data, as the tutorial did::

    python logistic_sgd.py [--dataset PATH] [--epochs 20]
    THEANO_FLAGS=device=cuda0 python logistic_sgd.py   # on GPU 0, through PyTensor's JAX backend
    THEANO_FLAGS=mode=NUMBA python logistic_sgd.py     # on the CPU through Numba, not JAX
"""
import signal
import sys

if __name__ == "__main__":  # a Ctrl-C while PyTensor loads ends the script, with no traceback
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.path.insert(0, __file__.rpartition("/")[0])  # the package, under python -I too
import multi_gpu.tutorial as tutorial  # first: THEANO_FLAGS onto PyTensor's flags; data; options

import time

import numpy as np
import pytensor
import pytensor.tensor as pt


class LogisticRegression:
    """Multi-class logistic regression.

    Fully described by ``W`` (n_in x n_out) and ``b`` (n_out,); classes are
    the columns of ``W``.
    """

    def __init__(self, input, n_in, n_out):
        """
        :param input: symbolic matrix, one minibatch (n_examples, n_in)
        :param n_in: dimension of an input example (784 for MNIST's 28x28)
        :param n_out: number of classes (10)
        """
        floatX = pytensor.config.floatX
        self.W = pytensor.shared(np.zeros((n_in, n_out), dtype=floatX), name="W", borrow=True)
        self.b = pytensor.shared(np.zeros((n_out,), dtype=floatX), name="b", borrow=True)
        self.n_out = n_out

        # symbolic (n_examples, n_out) matrix of class-membership probabilities,
        # and its logarithm computed stably (log-sum-exp) for the cost
        activation = pt.dot(input, self.W) + self.b
        self.p_y_given_x = pt.special.softmax(activation, axis=1)
        self.log_p_y_given_x = pt.special.log_softmax(activation, axis=1)

        # symbolic (n_examples,) vector of predicted classes
        self.y_pred = pt.argmax(self.p_y_given_x, axis=1)

        self.params = [self.W, self.b]
        self.input = input

    def negative_log_likelihood(self, y):
        """Mean negative log-likelihood of the correct labels ``y``:

        .. math::

            \\mathcal{L}(\\theta, \\mathcal{D}) = -\\frac{1}{|\\mathcal{D}|}
                \\sum_{i=0}^{|\\mathcal{D}|} \\log(P(Y=y^{(i)}|x^{(i)}, W,b))

        We use the mean rather than the sum so that the learning rate does not
        depend on the minibatch size.

        The tutorial picks each row's entry with ``[T.arange(y.shape[0]), y]``;
        JAX cannot compile an ``arange`` of a length known only at run time, so
        the same entries are picked here by a one-hot mask over the fixed
        number of classes.
        """
        one_hot = pt.eq(y[:, None], pt.arange(self.n_out)[None, :])
        return -pt.mean(pt.sum(self.log_p_y_given_x * one_hot, axis=1))

    def errors(self, y):
        """Fraction of the examples in the minibatch that are misclassified
        (the zero-one loss over the minibatch)."""
        if y.ndim != self.y_pred.ndim:
            raise TypeError("y should have the same shape as self.y_pred",
                            ("y", y.type, "y_pred", self.y_pred.type))
        return pt.mean(pt.neq(self.y_pred, y))


def shared_dataset(data_xy, borrow=True, put=None):
    """Load a split into shared variables.

    Shared variables let the compiled functions read the data in place (on a
    GPU: keep it in device memory) instead of copying a minibatch in at
    every call.  ``put`` places an array on the device that computes
    (``jax.device_put`` for a GPU); a shared variable holding a NumPy array
    would be sent there again at every call.
    """
    data_x, data_y = data_xy
    shared_x = pytensor.shared(np.asarray(data_x, dtype=pytensor.config.floatX), borrow=borrow)
    shared_y = pytensor.shared(np.asarray(data_y, dtype="int32"), borrow=borrow)
    if put is not None:
        for shared in (shared_x, shared_y):
            shared.container.storage[0] = put(shared.container.storage[0])
    return shared_x, shared_y


def load_data(dataset, put=None):
    """Read a data set (see ``multi_gpu/datasets.py``) into shared variables.

    :param dataset: path to ``mnist.pkl.gz`` or to a folder of IDX files
    :param put: places each array on the computing device (see ``shared_dataset``)
    :returns: ``[(train_x, train_y), (valid_x, valid_y), (test_x, test_y)]``
    """
    return [shared_dataset(split, put=put) for split in tutorial.read(dataset)]


def minibatch(data, index, batch_size):
    """Symbolic minibatch ``index`` of a shared data set: the rows
    ``index * batch_size`` to ``(index + 1) * batch_size``.

    The tutorial writes ``data[index * batch_size:(index + 1) * batch_size]``;
    JAX cannot compile a slice whose bounds are only known at run time, so
    the data is viewed as (n_batches, batch_size, ...) and indexed instead.
    """
    if batch_size == 1:  # one row, as a batch of one (a (n, 1, ...) view trips a PyTensor rewrite)
        return pt.shape_padleft(data[index])
    n_batches = data.get_value(borrow=True).shape[0] // batch_size
    rows = data[:n_batches * batch_size]
    return rows.reshape((n_batches, batch_size) + tuple(rows.shape[1:data.ndim]))[index]


def sgd_optimization_mnist(learning_rate=0.13, n_epochs=20, dataset=None, batch_size=600,
                           device=None):
    """Stochastic gradient descent on a log-linear model, the tutorial's loop
    reduced to its core: train on every minibatch, validate after each epoch,
    keep the test error of the best-validation model.

    :param device: a JAX device (the CPU, or a GPU: ``THEANO_FLAGS=device=cuda0``):
        every function compiles for it, and the data and the weights live
        there; or None for the CPU with the mode the flags name
        (``THEANO_FLAGS=mode=NUMBA``)
    """
    dataset, notice = tutorial.resolve(dataset)
    if notice:
        print(notice)
    mode, put = (device.mode, device.put) if device else (None, None)
    (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = load_data(dataset, put=put)
    n_train_batches = train_x.get_value(borrow=True).shape[0] // batch_size
    if n_train_batches == 0:
        raise tutorial.DatasetError(f"batch size {batch_size} is larger than the training set")

    print("... building the model")
    index = pt.lscalar()
    x = pt.matrix("x")
    y = pt.ivector("y")
    classifier = LogisticRegression(input=x, n_in=tutorial.N_PIXELS, n_out=tutorial.N_CLASSES)
    cost = classifier.negative_log_likelihood(y)
    g_W, g_b = pytensor.grad(cost=cost, wrt=[classifier.W, classifier.b])
    train_model = pytensor.function(
        [index], cost,
        updates=[(classifier.W, classifier.W - learning_rate * g_W),
                 (classifier.b, classifier.b - learning_rate * g_b)],
        givens={x: minibatch(train_x, index, batch_size), y: minibatch(train_y, index, batch_size)},
        mode=mode)
    validate_model = pytensor.function([], classifier.errors(y), givens={x: valid_x, y: valid_y},
                                       mode=mode)
    test_model = pytensor.function([], classifier.errors(y), givens={x: test_x, y: test_y},
                                   mode=mode)
    with tutorial.heartbeat(tutorial.compiling("the model", mode, device.name if device else
                                               "cpu")):
        for f in (validate_model, test_model):  # compiled on the first call
            f()
        saved = [p.get_value() for p in classifier.params]
        train_model(0)
        for p, value in zip(classifier.params, saved):
            p.set_value(value)
            if put:  # held on the device: a NumPy value would be sent there at every call
                p.container.storage[0] = put(value)

    print("... training the model")
    best_validation_loss, test_score, train_time = np.inf, np.inf, 0.0
    for epoch in range(1, n_epochs + 1):
        start = time.perf_counter()
        for minibatch_index in range(n_train_batches):
            train_model(minibatch_index)
        train_time += time.perf_counter() - start
        tutorial.check_finite([p.get_value() for p in classifier.params], epoch, learning_rate,
                              kept="")
        this_validation_loss = float(validate_model())
        print(f"epoch {epoch}, minibatch {n_train_batches}/{n_train_batches}, "
              f"validation error {this_validation_loss * 100.:f} %")
        if this_validation_loss < best_validation_loss:
            best_validation_loss = this_validation_loss
            test_score = float(test_model())
    print(f"Optimization complete with best validation score of {best_validation_loss * 100.:f} %, "
          f"with test performance {test_score * 100.:f} %")
    print(f"The code ran for {n_epochs / train_time:.2f} epochs/s of training "
          f"({n_epochs * n_train_batches * batch_size / train_time:,.0f} samples/s; the compile "
          "and the validation not counted)")
    return best_validation_loss, test_score


def main(argv=None):
    tutorial.quiet_start_up()
    parser = tutorial.parser("Train logistic regression on MNIST, as in the deeplearning.net "
                             "tutorial (on a GPU with THEANO_FLAGS=device=cuda0).", epochs=20,
                             batch_size=100, learning_rate=0.13)
    args = parser.parse_args(argv)
    return tutorial.run("logistic_sgd.py", lambda: sgd_optimization_mnist(
        args.learning_rate, args.epochs, args.dataset, args.batch_size,
        tutorial.device_from_flags()), args.dataset)


if __name__ == "__main__":
    sys.exit(main())
