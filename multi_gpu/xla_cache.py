"""XLA's persistent compilation cache, as the workers use it.

A second run loads its programs instead of compiling them
(``keep_compiled_programs``), and says which it did (``CACHE``); under
``--exchange xla`` on CPUs every process keeps its own programs
(``every_cpu_process_keeps_its_programs``); a program with a Python
callback in it is compiled without the cache (``not_kept``).
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import collections
import contextlib
import os
import warnings


def jax_cache_folder():
    """Where JAX keeps what it compiled: beside PyTensor's own cache."""
    import pytensor
    return os.path.join(pytensor.config.base_compiledir, "jax_cache")


# what XLA's persistent cache did in this process: programs it served ("hits"),
# programs it had not ("misses", compiled then), and the seconds its reads took
CACHE = collections.Counter()


CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits",
                "/jax/compilation_cache/cache_misses": "misses"}


def keep_compiled_programs(jax):
    """JAX's persistent compilation cache, for every program (not only the
    slow ones): a second run loads its programs instead of compiling them,
    and ``CACHE`` counts which it did."""
    folder = jax_cache_folder()
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if not CACHE:  # listen once per process
        CACHE["listening"] = 1
        # an empty cache serves only what this run (another worker, or this
        # process, compiling the same program twice) has just put there
        CACHE["empty_at_start"] = int(not (os.path.isdir(folder) and os.listdir(folder)))
        jax.monitoring.register_event_listener(
            lambda event, **_: CACHE.update([CACHE_EVENTS[event]] if event in CACHE_EVENTS
                                            else []))

        def loading(event, seconds, **_):
            if event == "/jax/compilation_cache/cache_retrieval_time_sec":
                CACHE["loading_s"] += seconds
        jax.monitoring.register_event_duration_secs_listener(loading)
        global CACHE_PROBLEM
        CACHE_PROBLEM = every_cpu_process_keeps_its_programs(jax)


CACHE_PROBLEM = None  # why not every CPU process keeps its own programs, where they do not


def cache_problem():
    """What XLA's cache cannot do for this process, in words, where it
    matters: a CPU worker of JAX's distributed runtime (None elsewhere)."""
    if CACHE_PROBLEM is None:
        return None
    from jax._src import distributed
    return CACHE_PROBLEM if distributed.global_state.client is not None else None


def cache_writer_problem(jax):
    """Why JAX's private writer of its persistent cache is not one
    ``every_cpu_process_keeps_its_programs`` can wrap, in words (None where
    it is: its arguments are JAX 0.10's, or 0.12's, which dropped the
    program's host callbacks)."""
    import inspect

    from jax._src import compiler
    write = getattr(compiler, "_cache_write", None)
    known = ["cache_key", "compile_time_secs", "module_name", "backend", "executable"]
    if write is not None and list(inspect.signature(write).parameters) in (
            known, known + ["host_callbacks"]):
        return None
    return (f"JAX {jax.__version__}'s private jax._src.compiler._cache_write is not the "
            "writer this demo wraps: under --exchange xla on CPUs every worker but the first "
            "compiles its programs again on every run")


def every_cpu_process_keeps_its_programs(jax):
    """JAX writes its persistent cache from process 0 alone, so that a cache
    on shared storage does not take every process's copy of the same
    programs.  A GPU program's key is the same in every process; a CPU
    program's is not (the CPU topology's fingerprint names the process), so
    under ``--exchange xla`` on CPUs every worker but the first found nothing
    of its own and compiled all its programs again on every run (a
    two-worker run on two cores: 7.4 s, and 4.6 s once each keeps its own).
    Here each CPU process writes its own, by a wrapper around JAX's private
    writer; where that is not the writer expected (``cache_writer_problem``:
    another JAX), they compile as before, and this returns why, in words."""
    from jax._src import compilation_cache, compiler, distributed
    problem = cache_writer_problem(jax)
    if problem:
        return problem
    write = compiler._cache_write

    def own_programs_too(cache_key, compile_time_secs, module_name, backend, executable,
                         *host_callbacks):  # JAX 0.10: one more, the program's callbacks
        if distributed.global_state.process_id == 0 or backend.platform != "cpu" or \
                any(host_callbacks) or \
                compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return write(cache_key, compile_time_secs, module_name, backend, executable,
                         *host_callbacks)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable,
                                                      backend, int(compile_time_secs))
        except Exception as e:  # as JAX's own writer: a cache that fails costs a compile
            warnings.warn(f"XLA's cache kept no copy of {module_name}: {e}", stacklevel=2)
    compiler._cache_write = own_programs_too
    return None


@contextlib.contextmanager
def not_kept(jax):
    """Compile without writing to the persistent cache: a program with a
    Python callback in it (the GPU-ordered exchange) would come back from
    the cache without its callback."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
