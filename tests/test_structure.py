"""The shape of the repository: three scripts on top of one package, whose
modules import one another without cycles, and THEANO_FLAGS honoured
whichever module a process imports first."""
import ast
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPTS = ("dual_mlp", "mlp", "logistic_sgd")
PACKAGE = sorted(p[:-3] for p in os.listdir(ROOT / "multi_gpu")
                 if p.endswith(".py") and p != "__init__.py")


def imported(path):
    """The modules a file imports (``from multi_gpu import a, b`` counts a and b),
    top level and inside functions alike."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "multi_gpu":
                names |= {f"multi_gpu.{a.name}" for a in node.names}
    return names


def test_the_package_never_imports_a_script_and_its_imports_have_no_cycle():
    assert imported(ROOT / "multi_gpu" / "__init__.py") == set()
    graph = {}
    for name in PACKAGE:
        uses = imported(ROOT / "multi_gpu" / f"{name}.py")
        assert not uses & set(SCRIPTS), (name, uses & set(SCRIPTS))
        graph[name] = {u.split(".")[1] for u in uses
                       if u.startswith("multi_gpu.") and u.split(".")[1] != name}
    done, path = set(), []

    def visit(module):  # depth first: a module met again on the current path closes a cycle
        assert module not in path, " -> ".join(path + [module])
        if module in done:
            return
        path.append(module)
        for other in graph[module]:
            visit(other)
        path.pop()
        done.add(module)
    for module in graph:
        visit(module)


def test_the_door_imports_zmq_alone():
    """Node 0's door (``multi_gpu.door``) starts as a script in a process of
    its own: nothing of the package, nothing that needs PyTensor's flags."""
    assert imported(ROOT / "multi_gpu" / "door.py") == {
        "collections", "json", "os", "shutil", "sys", "tempfile", "time", "zmq",
        "zmq.auth.thread"}


def test_the_tutorial_scripts_take_one_line_from_the_package():
    for script in ("mlp.py", "logistic_sgd.py"):
        tree = ast.parse((ROOT / script).read_text())
        lines = [node for node in ast.walk(tree)
                 if isinstance(node, (ast.Import, ast.ImportFrom))
                 and "multi_gpu" in ((node.module or "") if isinstance(node, ast.ImportFrom)
                                     else node.names[0].name)]
        assert len(lines) == 1, (script, [ast.unparse(n) for n in lines])
        others = {m.split(".")[0] for m in imported(ROOT / script)} - {"multi_gpu"}
        assert others <= {"numpy", "pytensor", "functools", "shlex", "signal", "sys", "time",
                          "logistic_sgd", "mlp"}, (script, others)


# node 0's door is a script of its own, run by path, which imports zmq and no PyTensor
# (test_the_door_imports_zmq_alone): it needs no flags
@pytest.mark.parametrize("module", [f"multi_gpu.{m}" for m in PACKAGE if m != "door"]
                         + list(SCRIPTS))
def test_theano_flags_reach_pytensor_whichever_module_is_imported_first(module):
    """A fresh process imports ``module`` first, then PyTensor: Theano's mode
    name and floatX have become PyTensor's."""
    env = dict(os.environ, THEANO_FLAGS="mode=DEBUG_MODE,floatX=float64")
    env["PYTENSOR_FLAGS"] = f"base_compiledir={os.environ['DUAL_MLP_TESTS_CACHE']}"
    out = subprocess.run([sys.executable, "-c", f"import {module}, pytensor; "
                          "print(pytensor.config.mode, pytensor.config.floatX)"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["DebugMode", "float64"], (out.stdout, out.stderr)


def test_the_constraints_pin_every_requirement_on_every_python_ci_tests():
    """requirements-constraints.txt (``bash .ci/run --pin``) holds, for each
    Python that .ci/run tests, a version of every package the requirements
    name that the requirement admits: ``pip install -r requirements.txt -c
    requirements-constraints.txt`` reproduces a green run on any of them."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    pythons = re.search(r"^PYTHONS=\((.*)\)$", (ROOT / ".ci" / "run").read_text(), re.M)
    pythons = pythons.group(1).split()
    assert len(pythons) >= 2  # the oldest and the newest supported (issue 53)
    readme = (ROOT / "README.md").read_text()
    assert f"Python {pythons[0]} to {pythons[-1]}" in readme

    def lines(name):
        for line in (ROOT / name).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                yield Requirement(line)
    pins = list(lines("requirements-constraints.txt"))
    for python in pythons:
        env = {"python_version": python}
        pinned = {canonicalize_name(pin.name): pin.specifier for pin in pins
                  if not pin.marker or pin.marker.evaluate(env)}
        for wanted in (*lines("requirements.txt"), *lines("requirements-test.txt")):
            if wanted.marker and not wanted.marker.evaluate(env):
                continue
            name = canonicalize_name(wanted.name)
            assert name in pinned, f"{name} is not pinned for Python {python}"
            exact = next(iter(pinned[name]))
            assert exact.operator == "==" and wanted.specifier.contains(exact.version), \
                f"{name}: {exact} for Python {python} is not {wanted}"


def test_the_gpu_requirements_install_whole_without_a_cuda_toolkit(tmp_path):
    """pip resolves requirements-gpu.txt, and all it brings, to wheels alone
    (--only-binary :all:, as a dry run): nothing is built, so a machine
    without the CUDA toolkit installs it whole.  PyCUDA, which PyPI has only
    as source, is requirements-pycuda.txt's, and the README's GPU set-up
    names what its build needs."""
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                          "--ignore-installed", "--only-binary", ":all:", "--report",
                          tmp_path / "report.json", "-r", ROOT / "requirements-gpu.txt"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    names = {i["metadata"]["name"].lower() for i in
             json.loads((tmp_path / "report.json").read_text())["install"]}
    assert {"jax-cuda13-plugin", "pytensor", "pyzmq"} <= names and "pycuda" not in names, names
    pycuda = [line for line in (ROOT / "requirements-pycuda.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert pycuda == ["pycuda>=2024.1"], pycuda
    readme = (ROOT / "README.md").read_text()
    assert "CUDA_ROOT=/usr/local/cuda pip install -r requirements-pycuda.txt" in readme


def test_ruff_finds_nothing_anywhere():
    """pyflakes, pycodestyle at the project's line length, bugbear, no
    function past a McCabe complexity of 10, the imports in isort's order
    (PyTensor's flags first), and the format: PEP 8's indentation,
    whitespace and blank lines (ruff.toml), on every file; no cache left in
    the clone."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_lesson_fits_in_650_lines_and_each_module_in_500():
    """dual_mlp.py is read first and whole, as the 2014 file was: at most
    650 lines, one fact a line, no line continued by a backslash (which
    hides a definition from the tools that read them); every module of the
    package at most 500."""
    lesson = (ROOT / "dual_mlp.py").read_text()
    assert len(lesson.splitlines()) <= 650
    assert not [line for line in lesson.splitlines() if line.rstrip().endswith("\\")]
    for path in (ROOT / "multi_gpu").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 500, path.name


def test_nothing_assigns_to_the_parsed_options_and_the_runs_life_is_named():
    """The parsed options are never changed after parsing: the checks fill in
    a draft and freeze it into one ``request.Plan``, which a restart
    replaces whole (issue 71).  The run's life is the supervisor's ``State``
    and a node's standing a ``NodeState``, Enums, not strings; what ends a
    launch and how a restart goes are named records."""
    import dataclasses
    import enum

    from multi_gpu import nodes, request, supervisor
    for path in [ROOT / "dual_mlp.py", *(ROOT / "multi_gpu").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for leaf in ast.walk(target):
                    assert not (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                                and leaf.value.id in ("args", "plan")), \
                        (path.name, node.lineno, ast.unparse(node))
    assert request.Plan.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        object.__new__(request.Plan).epochs = 1
    assert issubclass(supervisor.State, enum.Enum) and issubclass(nodes.NodeState, enum.Enum)
    assert nodes.Standing.__annotations__["state"] is nodes.NodeState
    for record in (supervisor.Outcome, supervisor.Restart, nodes.Standing):
        assert dataclasses.is_dataclass(record)


STEP_PROFILER = """
import functools, json, os, sys
sys.path.insert(0, os.getcwd())
import threadpoolctl
import zmq
import dual_mlp
seen, calls, watching = set(), set(), []

def recorded(name, method):  # a zmq call, by the function that makes it, while watching
    @functools.wraps(method)
    def call(*args, **kwargs):
        if watching:
            caller = sys._getframe(1).f_code
            calls.add((caller.co_filename, caller.co_name, name))
        return method(*args, **kwargs)
    return call
for name in ("send", "recv", "poll", "send_pyobj", "recv_pyobj", "send_multipart",
             "recv_multipart", "send_string", "recv_string", "send_json", "recv_json"):
    setattr(zmq.Socket, name, recorded(name, getattr(zmq.Socket, name)))

def watched(method, step):  # the handshake, or the steps: every function they run, by file
    def run(self, *args):
        watching.append(True)
        if step:
            sys.setprofile(lambda frame, event, _: event == "call" and
                           seen.add(frame.f_code.co_filename))
        try:
            return method(self, *args)
        finally:
            sys.setprofile(None)
            watching.clear()
    return run

def leave(self):
    blas = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
    with open(os.path.join(sys.argv[1], f"worker{self.rank}.json"), "w") as f:
        json.dump(dict(files=sorted(seen), calls=sorted(calls), blas_threads=blas), f)
    close(self)

close = dual_mlp.HostOrdered.close
dual_mlp.HostOrdered.handshake = watched(dual_mlp.HostOrdered.handshake, step=False)
dual_mlp.HostOrdered.epoch = watched(dual_mlp.HostOrdered.epoch, step=True)
dual_mlp.HostOrdered.close = leave
sys.exit(dual_mlp.main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def quick_start_workers(tmp_path_factory):
    """The Quick start's run, one epoch: each worker's steps traced
    (``sys.setprofile``: every function), every zmq call of its handshake
    and steps by the function that makes it, and its BLAS threads counted
    (threadpoolctl)."""
    folder = tmp_path_factory.mktemp("profiled")
    out = subprocess.run([sys.executable, "-c", STEP_PROFILER, str(folder), "--epochs", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return [json.loads((folder / f"worker{rank}.json").read_text()) for rank in (0, 1)]


def ours(path):
    """A project file's path in the repository, or None."""
    inside = path.startswith(str(ROOT) + os.sep) and not path.startswith(sys.prefix)
    return os.path.relpath(path, ROOT) if inside else None


def test_one_step_runs_python_of_three_project_files_at_most(quick_start_workers):
    """Whatever a reader of the step follows is in dual_mlp.py and two files
    of the package at most (the model's own step is compiled: it runs no
    Python of mlp.py)."""
    for worker in quick_start_workers:
        files = set(filter(None, map(ours, worker["files"])))
        assert "dual_mlp.py" in files and len(files) <= 3, files


def test_every_zmq_call_of_the_handshake_and_the_step_is_in_the_lesson(quick_start_workers):
    """The handshake and every step call zmq (send, recv, poll, send_pyobj,
    recv_pyobj) from dual_mlp.py alone, as the 2014 file did: in the
    functions that wait, signal and swap."""
    for worker in quick_start_workers:
        callers = {(ours(path), function, called) for path, function, called in worker["calls"]
                   if ours(path)}
        assert {path for path, _, _ in callers} == {"dual_mlp.py"}, callers
        assert {called for _, _, called in callers} >= {"poll", "send", "recv", "send_pyobj",
                                                        "recv_pyobj"}, callers
        assert {function for _, function, _ in callers} == {"wait_for_worker", "barrier",
                                                            "swap"}, callers


def test_a_forked_cpu_worker_keeps_to_its_part_of_the_cores(quick_start_workers):
    """NumPy's BLAS took its threads as the launcher imported it; each of
    the two CPU workers uses half the cores (a Numba step, which calls BLAS,
    ran 4 to 10 times slower with both on every core)."""
    for worker in quick_start_workers:
        assert set(worker["blas_threads"]) == {max(1, (os.cpu_count() or 2) // 2)}, worker
