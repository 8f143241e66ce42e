"""Writes requirements-constraints.txt's text from the virtual environments of a
green CI run (``bash .ci/run --pin``), oldest Python first: each package pinned
to the version that run installed, under a marker for the Pythons that resolve
to it, so that ``pip install -r requirements.txt -c requirements-constraints.txt``
installs what CI tested, on any of them."""
import datetime
import subprocess
import sys
from pathlib import Path


def frozen(venv):
    """The venv's Python version ("3.11") and its packages, {name: version}."""
    python = Path(venv) / "bin" / "python"
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    lines = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    return version, dict(line.lower().split("==", 1) for line in lines if "==" in line)


def marker(versions, i):
    """Where the i-th Python's pins apply: up to the next tested Python's minor version."""
    def above(v):
        major, minor = map(int, v.split("."))
        return f"{major}.{minor + 1}"
    bounds = ([f'python_version >= "{above(versions[i - 1])}"'] if i > 0 else []) + \
             ([f'python_version < "{above(versions[i])}"'] if i < len(versions) - 1 else [])
    return " and ".join(bounds)


def main(venvs):
    runs = [frozen(venv) for venv in venvs]
    versions = [version for version, _ in runs]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                      capture_output=True, text=True).stdout.strip():
        commit += "+changes"  # the run tested the tree, not the commit alone
    print(f"# The versions a green CI run installed (bash .ci/run --pin, "
          f"{datetime.date.today()}, commit {commit}), on Python {' and '.join(versions)}:\n"
          f"#   pip install -r requirements.txt -c requirements-constraints.txt")
    for name in sorted(set().union(*(packages for _, packages in runs))):
        pins = [packages.get(name) for _, packages in runs]
        if len(set(pins)) == 1:
            print(f"{name}=={pins[0]}")
            continue
        for i, pin in enumerate(pins):
            if pin:
                print(f"{name}=={pin} ; {marker(versions, i)}")


if __name__ == "__main__":
    main(sys.argv[1:])
