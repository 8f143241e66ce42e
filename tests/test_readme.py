"""The READMEs are true: the Quick start prints what README.md shows, every
command in them runs as typed from the repository's root, every results file
they name is in git, and every table is what its results file generates."""
import ast
import concurrent.futures
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, dual, head_of, unchanged

READMES = (ROOT / "README.md", ROOT / "bench" / "README.md")


def test_the_readme_shows_what_the_quick_start_prints(tmp_path, clone):
    """README.md's example output is what `python dual_mlp.py` prints on its
    first run in a fresh clone (caches empty: a private HOME), line for
    line, numbers aside (the speeds are the machine's), and the clone stays
    as it was.  The compile line may say that XLA's cache was empty (where
    a worker read a program another had just put there)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("The first run, its caches empty\n(this 2-core machine):\n\n```\n",
                         1)[1].split("```", 1)[0]
    example = [line for line in block.splitlines() if line != "..."]
    out = dual(env={"HOME": str(tmp_path)}, timeout=300, tree=clone)
    assert out.returncode == 0, out.stderr
    assert unchanged(clone)

    def shape(line):
        line = re.sub(r" \(XLA's cache was empty: it holds this run's programs now, for the "
                      r"next run\)$", "", line)
        return re.sub(r"\d[\d,.]*", "#", line)
    # a slow first compile's beats, and the notice of the other tests' runs beside it (the
    # README shows a run alone on its machine)
    printed = [shape(line) for line in out.stdout.splitlines()
               if not line.startswith("... still compiling")
               and not re.match(r"notice: \d+ other dual_mlp\.py launchers? of yours", line)]
    assert len(printed) == len(example) + 7  # the seven epoch lines the README leaves out
    assert all(shape(line) in printed for line in example), (example, printed)
    assert printed[:7] == [shape(line) for line in example[:7]]
    assert printed[-3:] == [shape(line) for line in example[-3:]]


def test_the_readmes_step_is_a_quote_of_the_code():
    """README.md shows the step as ``dual_mlp.py`` has it, between its
    ``start-snippet`` and ``end-snippet`` lines, line for line: one copy of
    the lesson, as the tutorial's pages quote its code, never retyped."""
    code = (ROOT / "dual_mlp.py").read_text()
    snippet = re.search(r"# start-snippet: the step[^\n]*\n(.*?)\n\s*# end-snippet: the step",
                        code, re.S)
    assert snippet, "dual_mlp.py lost its step's snippet markers"
    quote = f"```python\n{textwrap.dedent(snippet.group(1))}\n```"
    assert quote in (ROOT / "README.md").read_text(), quote


def test_the_reading_order_names_the_function_of_each_call_of_the_handshake_and_the_step():
    """README.md's reading order answers from dual_mlp.py alone, by the
    function that makes each call: when the handshake runs and what it
    calls, where one step trains, publishes, signals (the call that waits),
    copies and averages (under every --avg): each named function holds its
    call, whatever lines it moves to."""
    section = (ROOT / "README.md").read_text().split("## Reading order\n", 1)[1]
    rows, function = [], None
    for what, named, call in re.findall(r"^\| ([^|]*) \| (`[\w.]+`|) \| `([^`]+)` \|$",
                                        section.split("\n## ", 1)[0], re.M):
        function = named.strip("`") or function  # an empty cell: the function above
        rows.append((what, function, call))
    source = (ROOT / "dual_mlp.py").read_text()
    functions = {}
    for node in ast.parse(source).body:
        for inner in [node] + (node.body if isinstance(node, ast.ClassDef) else []):
            if isinstance(inner, ast.FunctionDef):
                name = f"{node.name}.{inner.name}" if inner is not node else inner.name
                functions[name] = ast.get_source_segment(source, inner)
    for what, function, call in rows:
        assert function in functions, (what, function)
        assert call in functions[function], (what, function, call)
    calls, whats = " ".join(call for _, _, call in rows), " ".join(what for what, _, _ in rows)
    for needed in ("trainer.handshake()", "send_pyobj", "recv_pyobj", "mem_get_ipc_handle",
                   "IPCMemoryHandle", "train_model", "memcpy_dtod_async", "socket.send(",
                   "socket.poll(", "socket.recv(", "self.exchange(params, g)",
                   "start-snippet: the step"):
        assert needed in calls, needed
    for avg in ("theano", "pycuda", "shared", "cpu"):
        assert f"`--avg {avg}`" in whats, avg


def test_the_readme_is_a_page():
    assert len((ROOT / "README.md").read_bytes()) <= 15 * 1024


def code_blocks(text):
    """A Markdown text's code blocks: [(language, lines)]."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            current = (line[3:], []) if current is None else blocks.append(current)
        elif current is not None:
            current[1].append(line)
    return blocks


def commands():
    """Every ``python ...`` command of both READMEs: each line of their code
    blocks (comments and ``VAR=value`` prefixes aside, ``&&`` chains split)
    and each "Measured by" line's."""
    found = []
    for readme in READMES:
        text = readme.read_text()
        for language, block in code_blocks(text):
            for line in block if language == "" else ():  # not the quoted Python
                for part in line.split(" #")[0].split("&&"):
                    if not re.match(r"\s*(\w+=\S*\s+)*python\s", part):
                        continue  # not a command: the output a block shows
                    words = shlex.split(part)
                    while words and re.fullmatch(r"\w+=\S*", words[0]):
                        words.pop(0)
                    if words and words[0] == "python":
                        found.append((readme.name, words))
        found += [(readme.name, shlex.split(c)) for c in re.findall(r"Measured by `([^`]+)`", text)]
    return found


def writes(words):
    """The paths a README command writes into, from the repository's root: its
    outputs' options, and a benchmark's default ``--out``."""
    from bench import common
    paths = [words[i + 1] + ("/results.json" if w == "--out" else "")
             for i, w in enumerate(words[:-1]) if w in ("--out", "--trace", "--save", "--json")]
    if words[1:2] == ["-m"] and words[2].startswith("bench.") and "--out" not in words:
        paths.append(os.path.relpath(common.OUT, ROOT) + "/results.json")
    return paths


def test_a_readme_command_writes_only_where_git_ignores(clone):
    """What the READMEs show a user writes only where git ignores (a
    benchmark's default out/, a run's outputs at the top of the clone), a
    "Measured by" command too (it names the results file and the ``--out``
    that keeps it there, a maintainer's refresh, without typing it): the
    clone stays as it was.  The trace command, run as typed in a fresh
    clone (two epochs, not three: its window is the second), leaves it as it
    was.  (The benchmarks' cheap forms run in the clone too: test_bench.)"""
    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT,
                              ).returncode == 0
    for readme, words in commands():
        for path in writes(words):
            assert ignored(path), (readme, words, path)
    text = (ROOT / "README.md").read_text()
    traced = shlex.split(re.search(r"`(python dual_mlp\.py cpu cpu --epochs 3 --trace[^`]+)`",
                                   text.replace("\n", " ")).group(1))
    out = dual(*traced[2:5], 2, *traced[6:], tree=clone)
    assert out.returncode == 0, out.stderr
    assert (clone / traced[-1]).exists() and (clone / traced[-1].replace(".json", ".png")).exists()
    about = json.loads((clone / traced[-1]).read_text())["otherData"]
    assert about["command"] == shlex.join(traced[:5] + ["2"] + traced[6:])
    assert about["commit"] == head_of(clone)  # the code it ran, named, when and where
    assert about["date"].startswith(time.strftime("%Y-", time.gmtime()))
    assert about["device_name"] and about["host"]
    assert unchanged(clone)


def program(words):
    """What a command runs: ``dual_mlp.py``, or ``-m bench.compare``."""
    return words[1:3] if words[1] == "-m" else words[1:2]


def test_every_python_command_in_the_readmes_runs_as_typed():
    """Each program a README runs answers ``--help`` with exit 0 from the
    repository's root, and knows every option the README gives it (no
    abbreviations are accepted, so each is an option's full name)."""
    found = commands()
    assert len(found) > 20, found

    def help_of(key):
        return subprocess.run([sys.executable, *key, "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    keys = sorted({tuple(program(words)) for _, words in found})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # a second each, of imports: at once
        outs = dict(zip(keys, pool.map(help_of, keys)))
    helps = {}
    for key, out in outs.items():
        assert out.returncode == 0, (key, out.stderr)
        helps[key] = out.stdout
    for readme, words in found:
        key = tuple(program(words))
        for option in (w.split("=")[0] for w in words[1 + len(key):] if w.startswith("--")):
            assert re.search(rf"(^|[\s\[]){re.escape(option)}\b", helps[key]), (readme, words,
                                                                                option)


def tracked(path):
    return subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=ROOT,
                          capture_output=True).returncode == 0 or \
        subprocess.run(["git", "ls-files", path], cwd=ROOT, capture_output=True,
                       text=True).stdout.strip() != ""


def test_every_results_file_a_readme_names_is_in_git():
    named = set()
    for readme in READMES:
        text = readme.read_text()
        named |= set(re.findall(r"bench/results/[\w./-]*\w/?", text))
        if readme.parent.name == "bench":  # its table's last column names the files alone
            for row in re.findall(r"^\|.*\| ([^|]*) \|$", text, re.M):
                named |= {f"bench/results/{n}" for n in re.findall(r"`([^`]+)`", row)}
    assert len(named) > 10, named
    missing = sorted(path for path in named if not tracked(path))
    assert missing == [], missing


def blocks():
    """(README, block name, text) of every generated block."""
    for readme in READMES:
        for name, text in re.findall(r"<!-- (.+?): begin -->\n(.*?)\n<!-- \1: end -->",
                                     readme.read_text(), re.S):
            yield readme.name, name, text


@pytest.mark.parametrize("readme, name, text", list(blocks()),
                         ids=[f"{r}:{n}" for r, n, _ in blocks()])
def test_every_generated_table_is_what_its_results_file_generates(readme, name, text):
    """Regenerated from the results file its first line names, with the
    table function of the script that wrote it (its summary, for a block
    ``NAME summary``), the block is what it is."""
    from bench import common
    source = re.match(r"Measured by `[^`]+` on [^`]+ `--out bench/results[^`]*` in "
                      r"`(bench/results/[^`]+\.json)`", text)
    assert source, text.splitlines()[0]
    document = common.load(ROOT / source.group(1))
    assert common.block_name(document, name.split()[0]) == name.removesuffix(" summary")
    module = importlib.import_module("bench." + name.split(".py")[0])
    assert (module.summary if name.endswith(" summary") else module.table)(document) == text
