"""The plumbing of ``dual_mlp.py``: what the lesson calls by name, one module each.

``trainer``          what the trainers share: the replica check, the loop of K steps a call,
                     the step clock, which minibatch a worker takes
``stream_exchange``  the GPU-ordered exchange: ``stream_exchange.cu`` compiled by PyCUDA,
                     launched inside XLA's step
``links``            the zmq links between workers, the transports through host memory,
                     the XLA exchange (JAX's distributed runtime)
``devices``          where a worker's arrays live: the CPU, a JAX device, a GPU
``launcher``         the launcher's side: checks, starts and supervises (and restarts) the
                     workers
``nodes``            several machines: the run's secret, node 0's lobby, the nodes' heartbeats
``worker``           the worker's side: stop signals, orphans, the watchdog
``report``           worker 0's words: the summary, a run that diverged
``records``          what a run leaves: checkpoints, the learning curve, the JSON summary
``datasets``         data readers (pickle, IDX), the shipped digits (``python -m
                     multi_gpu.datasets``)
``flags``            THEANO_FLAGS onto PyTensor's flags: every module imports it first
``cli``              what the scripts share at the command line
``tutorial``         the one import of ``mlp.py`` and ``logistic_sgd.py``

Importing the package itself imports nothing.
"""
