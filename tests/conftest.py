"""Shared helpers: the tests run the real scripts as real processes."""
import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FASHION = Path(os.environ.get("FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))


def script(name, *args, env=None, timeout=600, cwd=ROOT):
    """Run one of the repository's scripts to completion; returns CompletedProcess."""
    return subprocess.run([sys.executable, str(ROOT / name), *map(str, args)], cwd=cwd,
                          env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def dual(*args, **kw):
    return script("dual_mlp.py", *args, **kw)


def start_dual(*args, env=None, cwd=ROOT):
    """Start dual_mlp.py in its own process group, without waiting."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "dual_mlp.py"), *map(str, args)],
                            cwd=cwd, env=dict(os.environ, **(env or {})), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    STARTED.append(proc)
    return proc


# Runs started in their own process group outlive a pytest that is killed
# (a device call's time limit): one left training for 100000 epochs shared
# the GPUs with the next benchmark and made its figures wrong.
STARTED = []


def stop_started(*_):
    for proc in STARTED:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass


def stop_started_and_exit(signum, _frame):
    stop_started()
    sys.exit(128 + signum)


atexit.register(stop_started)
signal.signal(signal.SIGTERM, stop_started_and_exit)


def workers_of(launcher):
    return [p for p in psutil.Process(launcher.pid).children()
            if "--worker" in p.cmdline()]


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def leftover_workers():
    """dual_mlp worker processes still alive (zombies included) anywhere."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if "--worker" in (p.info["cmdline"] or []) and any(
                    c.endswith("dual_mlp.py") for c in p.info["cmdline"]):
                found.append(p)
        except psutil.Error:
            pass
    return found


def run_directories():
    """The launcher's private run directories that exist now."""
    return set(Path("/dev/shm").glob("dual_mlp-*")) | set(Path("/tmp").glob("dual_mlp-*"))


@pytest.fixture
def no_leftovers():
    """Fail the test if it leaves a worker process or a run directory behind."""
    before = run_directories()
    yield
    time.sleep(0.2)
    assert leftover_workers() == []
    assert run_directories() - before == set(), "run directory not removed"
