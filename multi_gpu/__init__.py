"""The plumbing of ``dual_mlp.py``: what the lesson calls by name, one module each.

``sockets``          the zmq sockets between one machine's workers (``Peer``), how long a wait
                     may last
``trainer``          the trainers' shared part: the replica check, the step clock, which
                     minibatch a worker takes, the loop of K steps a call (``--sync gpu``, xla)
``transports``       the flat layout of the weights; the staged transport through host memory
``stream_exchange``  the GPU-ordered exchange: ``stream_exchange.cu`` compiled by PyCUDA,
                     launched inside XLA's step
``xla_runtime``      the XLA exchange: JAX's distributed runtime, a ``pmean`` in the step
``devices``          where a worker's arrays live: the CPU, a JAX device, a GPU; which GPUs
                     there are
``memory``           the memory a worker may still take (the machine, cgroups, ulimit -v)
``xla_cache``        XLA's persistent cache of compiled programs
``request``          the launcher's checks of the request, and the run it prepares
``resume``           where a run resumes: --resume checked, a restart's checkpoint
``supervisor``       the run's life: start, train, wait for a lost node, restart, end
``launcher``         the launcher's side: forks and stops the worker processes
``nodes``            several machines: the run's secret, the nodes' heartbeats
``lobby``            node 0's lobby: who joins, who comes back, what each node keeps
``elastic``          --nodes MIN:MAX: a run that goes on with the nodes it has
``member``           every other node's membership of it: its knock, its heartbeats, what it
                     keeps of the run
``door``             the lobby's public socket, in a process of its own
``worker``           the worker's side: orphans, the watchdog, its exit and its one line
``hooks``            where a run may stop or fail on purpose: stop requests, the fault tests'
                     hook
``report``           worker 0's words: the summary, a run that diverged
``records``          what a run leaves: checkpoints, the learning curve, the JSON summary
``locks``            a run's outputs held: a lock beside each, their room set aside
``trace``            --trace: each phase a span, the timeline's JSON and its picture
``files``            the run's private folder (where, and dead runs' left behind); outputs
                     written whole, or not at all
``datasets``         data readers (pickle, IDX), the shipped digits (``python -m
                     multi_gpu.datasets``)
``safe_read``        a data file read as one that may be hostile: no FIFO, no gzip bomb, a
                     pickle of arrays and tuples alone
``flags``            THEANO_FLAGS onto PyTensor's flags: every module imports it first
``cli``              what the scripts share at the command line
``tutorial``         the one import of ``mlp.py`` and ``logistic_sgd.py``

Importing the package itself imports nothing.
"""
