"""``--trace PATH.json``: every worker's phases, step by step, as a picture.

Each worker keeps a ``Tracer``: for a bounded window of steps (by default 50
steps from the start of the second epoch, so that compiling and warming up
stay out), the start and end of every phase on the machine's monotonic
clock (CLOCK_MONOTONIC, one clock for every process of a machine), on
one or two tracks: the host's, and, where the device orders the step, the
device's.  Outside the window a phase pays one comparison; without
``--trace``, nothing (the trainers do not ask for a tracer at all).

At the end each worker leaves its spans in the run folder
(``trace-RANK.json``), and the first worker of each node merges its
node's into PATH (node R > 0: PATH.nodeR.json) in the Chrome trace-event
format (Perfetto, ui.perfetto.dev, and chrome://tracing open it: one process per worker, a
thread per track, each phase a complete event, ``"ph": "X"``), and draws
PATH.png beside it where matplotlib is installed: one lane per worker and
track, a few steps wide, the time in microseconds.

On a GPU under ``--sync gpu`` the exchange kernel stamps its own phases
with the GPU's clock (``%globaltimer``, ns) into a ring in host memory
(``stream_exchange.cu``: block 0 of the kernel, whose 128 blocks each do
the same), and ``DeviceClock`` puts those stamps on the host's clock.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import collections
import contextlib
import functools
import json
import math
import os
import stat
import time

from multi_gpu import files
from multi_gpu.hooks import fault_point

HOST, DEVICE = "host", "device"  # the tracks


class Tracer:
    """One worker's spans for the steps ``first`` .. ``first + count - 1``
    (counted over the whole run, from 0)."""

    def __init__(self, rank, first, count):
        self.rank, self.first, self.count = rank, first, count
        self.step, self.spans = -1, []
        self.about = {}  # what the trace should say of this worker (its device's clock)

    def at(self, step):
        """The step the worker is at now (global, from 0)."""
        self.step = step

    def traces(self, first, steps=1):
        """Do any of the steps ``first`` .. ``first + steps - 1`` fall in the window?"""
        return first < self.first + self.count and self.first < first + steps

    @property
    def on(self):
        return self.traces(self.step)

    def span(self, name, start_ns, end_ns, track=HOST, step=None, **args):
        """A phase of ``step`` (default: the step the worker is at) that ran
        from ``start_ns`` to ``end_ns`` (monotonic, ns)."""
        step = self.step if step is None else step
        if self.traces(step):
            self.spans.append(dict(name=name, track=track, start=start_ns, end=end_ns,
                                   step=step, **args))

    def write(self, rundir):
        """This worker's spans, into the run folder (whole, or not at all)."""
        path = os.path.join(rundir, f"trace-{self.rank}.json")
        with files.new_file(path + ".part", text=True) as f:
            json.dump(dict(spans=self.spans, about=self.about), f)
        os.replace(path + ".part", path)


class DeviceClock:
    """A GPU's clock put on the host's: at the start and at the end of the
    run, the host asks the GPU for its clock and stamps the round trip on
    its own (``StreamExchange.read_clock``): each reading is (the GPU's
    time, the GPU's minus the host's at the round trip's midpoint, half the
    round trip: how far off that can be).  Between the two the offset is
    taken as linear in time (the two clocks' rates differ by ``drift``)."""

    def __init__(self, start, end):
        self.start, self.end = start, end

    @property
    def drift(self):
        """(the end's offset - the start's) / the time between: parts of one."""
        return (self.end[1] - self.start[1]) / max(1, self.end[0] - self.start[0])

    def to_host(self, ns):
        """A GPU time, in ns of the host's monotonic clock."""
        return int(ns - self.start[1] - self.drift * (ns - self.start[0]))

    @property
    def error_ns(self):
        """How far off a time put on the host's clock can be: the wider reading's."""
        return max(self.start[2], self.end[2])

    def about(self):
        return dict(device_clock="%globaltimer of the GPU, on the host's clock to within "
                    f"{self.error_ns / 1e3:.1f} us (offsets measured at the run's start and "
                    f"end; their drift, {self.drift * 1e6:.1f} ppm, corrected)",
                    device_clock_error_us=self.error_ns / 1e3,
                    device_clock_drift_ppm=self.drift * 1e6)


def kernel_spans(tracer, stamped, rank, nbytes, clock_at_start, clock_at_end):
    """The device's track under ``--sync gpu`` on a GPU: each traced
    exchange's phases as block 0 of the kernel stamped them (``stamped``:
    [(step, call, stamp or None where its slot was written again before the
    host read it)]), and the training between two exchanges of one call,
    put on the host's clock by the GPU's clock read at the start and the end
    (``StreamExchange.read_clock``: (reading, tick))."""
    clock, previous = DeviceClock(clock_at_start[0], clock_at_end[0]), None
    for step, call, stamp in stamped:
        if stamp is None:
            continue
        at = {k: clock.to_host(int(stamp[k]))
              for k in ("begin", "published", "signalled", "seen", "written")}
        span = functools.partial(tracer.span, track=DEVICE, step=step, call=call)
        if previous and previous[0] == call:
            span("train", previous[1], at["begin"])
        span("publish", at["begin"], at["published"], bytes=nbytes)
        span("signal", at["published"], at["signalled"])
        if int(stamp["last"]) != rank:
            span(WAITING, at["signalled"], at["seen"], worker=int(stamp["last"]))
        span("copy + average", at["seen"], at["written"], bytes=nbytes)
        previous = (call, at["written"])
    tracer.about.update(clock.about(), device_clock_tick_ns=clock_at_start[1],
                        stamps_lost=sum(s is None for *_, s in stamped))


@contextlib.contextmanager
def timed(tracer, name):
    """The block, a span ``name`` of ``tracer``'s next step (where there is a
    tracer): what runs between two steps, as worker 0's validation."""
    start = now()
    yield
    if tracer:
        tracer.span(name, start, now(), step=tracer.step + 1)


def now():
    """The machine's monotonic clock, in ns (CLOCK_MONOTONIC: the one the
    barriers stamp their arrivals with, ``time.perf_counter``, reads too)."""
    return time.perf_counter_ns()


def gather(rundir, ranks, timeout):
    """Every worker's spans and what to say of it (``Tracer.write``),
    waiting for them up to ``timeout`` s."""
    deadline, found = time.monotonic() + timeout, {}
    while len(found) < len(ranks) and time.monotonic() < deadline:
        for rank in ranks:
            path = os.path.join(rundir, f"trace-{rank}.json")
            if rank not in found and os.path.exists(path):
                with files.open_file(path, text=True) as f:
                    found[rank] = json.load(f)
        time.sleep(0.01)
    missing = sorted(set(ranks) - set(found))
    if missing:
        raise TimeoutError(f"no trace from worker {missing[0]} within {timeout:g} s")
    return found


def chrome_trace(traces, devices, about):
    """The Chrome trace-event document of every worker's trace (``gather``):
    a process per worker, a thread per track, times in microseconds from the
    window's start; what a worker's trace says of it, in ``otherData``."""
    spans_of = {rank: t["spans"] for rank, t in traces.items()}
    start = min((s["start"] for spans in spans_of.values() for s in spans), default=0)
    events = []
    workers = {str(rank): t["about"] for rank, t in sorted(traces.items()) if t["about"]}
    if workers:
        about = dict(about, workers=workers)
    for rank, spans in sorted(spans_of.items()):
        events.append(dict(ph="M", name="process_name", pid=rank,
                           args=dict(name=f"worker {rank} ({devices[rank]})")))
        events.append(dict(ph="M", name="process_sort_index", pid=rank, args=dict(sort_index=rank)))
        for tid, track in enumerate((HOST, DEVICE)):
            if any(s["track"] == track for s in spans):
                events.append(dict(ph="M", name="thread_name", pid=rank, tid=tid,
                                   args=dict(name=track)))
        for s in spans:
            args = {k: v for k, v in s.items() if k not in ("name", "track", "start", "end")}
            events.append(dict(ph="X", name=s["name"], pid=rank,
                               tid=(HOST, DEVICE).index(s["track"]),
                               ts=(s["start"] - start) / 1e3, dur=(s["end"] - s["start"]) / 1e3,
                               args=args))
    return dict(traceEvents=events, displayTimeUnit="ns", otherData=about)


# one colour per phase, the same in every picture
WAITING = "waiting for a later worker"  # the one name of waiting: summary, trace, picture, README
COLOURS = {"train": "#4c72b0", "publish": "#dd8452", "signal": "#55a868", "copy": "#c44e52",
           "average": "#8172b3", "copy + average": "#a3508f", WAITING: "#bbbbbb",
           "queue": "#937860", "waiting for the device": "#e5e5e5", "steps": "#4c72b0",
           "validate": "#2f2f2f"}


def colour(name):
    return COLOURS.get(name, "#8c8c8c")


def plot(document, path, steps=4, first=None):
    """PATH.png: a lane per worker and track over the time that ``steps``
    steps from ``first`` (default: the window's first) took (three calls,
    where the device's track knows calls only), on the device's tracks where
    there are any (the host runs ahead of them), each phase in its colour,
    time in microseconds; None where matplotlib is not installed (said in
    one line)."""
    try:
        import matplotlib
    except ImportError:
        print("no trace picture: matplotlib is not installed (pip install matplotlib); the "
              "trace itself is written")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with matplotlib.rc_context({"text.parse_math": False}):  # a "$" in a name is a "$"
        return draw(plt, document, path, steps, first)


class TooMany(ValueError):
    """A picture of more phases than one can show."""


def draw(plt, document, path, steps, first):
    """``plot``'s picture, drawn with matplotlib's ``plt``."""
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    on_device = [e for e in events if e["tid"] == 1]
    keys = on_device or events
    first = min(e["args"]["step"] for e in keys) if first is None else first
    steps = max(steps, 3 * max(e["args"].get("steps", 1) for e in keys))
    timed = [e for e in keys if first <= e["args"]["step"] < first + steps]
    if not timed:
        raise ValueError(f"no step {first} in the trace")
    lo, hi = min(e["ts"] for e in timed), max(e["ts"] + e["dur"] for e in timed)
    shown = collections.defaultdict(list)  # by lane
    for e in events:
        if e["ts"] < hi and e["ts"] + e["dur"] > lo:
            shown[e["pid"], e["tid"]].append(e)
    bars = sum(map(len, shown.values()))
    if bars > MOST_BARS:
        raise TooMany(f"steps {first}-{first + steps - 1} hold {bars:,} phases, more than a "
                      f"picture shows ({MOST_BARS:,}): fewer --steps")
    lanes = sorted(shown)
    if len(lanes) > MOST_LANES:
        raise TooMany(f"{len(lanes)} workers' tracks, more than a picture shows ({MOST_LANES})")
    # the last step's exchange again, zoomed: its phases are slivers beside the training
    # (not where waiting fills it: GPUs taking turns on one)
    last = [e for e in keys if e["args"]["step"] == first + steps - 1]
    exchanged = [e for e in last if e["name"] not in ("train", "validate")]
    zoom = exchanged and (min(e["ts"] for e in exchanged),
                          max(e["ts"] + e["dur"] for e in last))
    work = sum(e["dur"] for e in exchanged if not e["name"].startswith("waiting"))
    if zoom and (zoom[1] - zoom[0]) * len({(e["pid"], e["tid"]) for e in exchanged}) > 10 * work:
        zoom = None
    fig, axes = plt.subplots(2 if zoom else 1, squeeze=False,
                             figsize=(12, (0.7 * len(lanes) + 1.6) * (1.8 if zoom else 1)))
    seen = {}
    for ax, (start, end) in zip(axes[:, 0], [(lo, hi)] + ([zoom] if zoom else [])):
        lanes_in(ax, shown, lanes, start, end, seen)
        both = {pid for pid, tid in lanes if tid == 1}  # a worker with a device's track too
        ax.set_yticklabels([names[pid] + (f", {(HOST, DEVICE)[tid]}'s track" if pid in both
                                          else "") for pid, tid in reversed(lanes)])
        ax.set_xlabel("microseconds")
    ax = axes[0, 0]
    ax.set_title(f"{document['otherData']['title']}:\n{which_steps(document, first, steps)}"
                 + (" on the devices" if on_device else ""))
    if zoom:
        axes[1, 0].set_title(f"the last step's exchange, zoomed: {zoom[1] - zoom[0]:.0f} us",
                             fontsize=9)
    axes[-1, 0].legend(seen.values(), seen.keys(), loc="upper center",
                       bbox_to_anchor=(0.5, -0.32), ncol=min(5, len(seen)), fontsize=8,
                       frameon=False)
    fig.tight_layout()
    with files.atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)
        fault_point("trace", "write")  # the tests' hook: a picture not yet in place
    plt.close(fig)
    return path


def lanes_in(ax, shown, lanes, lo, hi, seen):
    """Each lane's phases from ``lo`` to ``hi`` (us) as bars on ``ax``, each
    phase's first bar kept in ``seen`` for the legend."""
    for y, lane in enumerate(reversed(lanes)):
        for e in shown[lane]:
            start, end = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            if end <= start:
                continue
            bar = ax.broken_barh([(start - lo, max(end - start, (hi - lo) / 2000))],
                                 (y - 0.35, 0.7), color=colour(e["name"]), edgecolor="white",
                                 linewidth=0.3)
            key = "validate (worker 0)" if e["name"] == "validate" else e["name"]
            seen.setdefault(key, bar)
    ax.set_yticks(range(len(lanes)))


def which_steps(document, first, steps):
    """The picture's steps in words: the epoch and the steps in it where the
    trace says where its window starts (``window``), else the run's step
    numbers (counted from 0)."""
    window = document["otherData"].get("window", {})
    if not {"epoch", "first_step", "steps_per_epoch"} <= set(window):
        return f"steps {first}-{first + steps - 1}"
    per, skip = window["steps_per_epoch"], first - window["first_step"]
    return (f"{steps} steps from epoch {window['epoch'] + skip // per}'s step {skip % per + 1} "
            f"(of {per} an epoch)")


# the most a trace that ``python -m multi_gpu.trace`` redraws may hold: about 50,000
# worker-steps (a --trace writes about 1.3 KB a step a worker; larger ones open in Perfetto)
MOST_BYTES = 64 << 20
MOST_BARS, MOST_LANES = 20000, 128  # phases, and workers' tracks, in one picture


class NotATrace(ValueError):
    """A file that is not a trace this project wrote: why, in a few words."""


def read(path):
    """The trace at ``path``, checked to be one ``chrome_trace`` writes before
    anything in it is used: a regular file (not a FIFO, which would block,
    nor a device, which never ends) of at most MOST_BYTES, JSON with finite
    numbers, nested as the project writes it, every event of the kinds
    and fields the picture reads."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise NotATrace(f"cannot read it: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotATrace("not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MOST_BYTES:
            raise NotATrace(f"{st.st_size / 2**20:.0f} MB, more than the "
                            f"{MOST_BYTES >> 20} MB this tool redraws (ui.perfetto.dev opens it)")
        raw = f.read(MOST_BYTES + 1)

    def no_constant(name):
        raise NotATrace(f"{name} in it, where a trace has numbers")
    try:
        document = json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        raise NotATrace("nested deeper than a trace") from None
    except ValueError as e:  # JSON's errors, and bytes that are not UTF-8
        raise NotATrace(str(e).split("\n")[0][:120]) from None
    check(document)
    return document


def check(document):
    """Refuse (``NotATrace``) a document that ``chrome_trace`` would not have written."""
    def need(ok, what):
        if not ok:
            raise NotATrace(what)

    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def count(x, most=1 << 31):
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < most

    def text(x, most):  # what a picture can draw: no lone surrogate, no control character
        return isinstance(x, str) and len(x) <= most and x.isprintable()
    need(isinstance(document, dict) and isinstance(document.get("traceEvents"), list),
         "no traceEvents list")
    about = document.get("otherData")
    need(isinstance(about, dict) and text(about.get("title"), 200), "no otherData title")
    window = about.get("window", {})
    need(isinstance(window, dict) and all(count(v) for v in window.values())
         and window.get("steps_per_epoch", 1) > 0, "a window that is not a trace's")
    named, kinds, phases = set(), set(), 0
    for e in document["traceEvents"]:
        need(isinstance(e, dict) and e.get("ph") in ("M", "X") and count(e.get("pid"), 1 << 16)
             and text(e.get("name"), 100) and isinstance(e.get("args"), dict),
             "an event that is not one of a trace's")
        if e["ph"] == "M":
            if e["name"] == "process_name":
                need(text(e["args"].get("name"), 100), "a worker without a name")
                named.add(e["pid"])
            continue
        args = e["args"]
        need(e.get("tid") in (0, 1) and number(e.get("ts")) and number(e.get("dur"))
             and e["dur"] >= 0 and count(args.get("step"))
             and count(args.get("steps", 1), 1 << 20), f"a phase without its times: {e}"[:200])
        need(e["pid"] in named, f"a phase of worker {e['pid']}, which it does not name")
        phases += 1
        kinds.add(e["name"])
    need(phases, "no phases in it")
    need(len(kinds) <= 20, f"{len(kinds)} kinds of phase, where a trace has a few")


def main(argv=None):
    """``python -m multi_gpu.trace PATH.json``: draw PATH.png again from a trace."""
    from multi_gpu import cli
    cli.quiet_start_up()
    parser = cli.Parser(prog="python -m multi_gpu.trace",
                        about="Draw a --trace file's picture again (PATH.png beside it).")
    parser.add_argument("trace", metavar="PATH.json")
    parser.add_argument("--first", type=int, metavar="STEP",
                        help="the picture's first step, counted over the run from 0 "
                        "(default: the trace's first)")
    parser.add_argument("--steps", type=cli.positive_int, default=4, metavar="N",
                        help="steps in the picture (default 4; three calls at least where the "
                        "device's track knows only calls)")
    args = parser.parse_args(argv)
    path, picture = args.trace, os.path.splitext(args.trace)[0] + ".png"
    if cli.same_file(path, picture):
        parser.error(f"{path}: the picture would be written over the trace: name it .json")
    try:
        document = read(path)
    except NotATrace as e:
        parser.error(f"{path}: not a --trace file of this project ({e})")
    steps = {e["args"]["step"] for e in document["traceEvents"] if e["ph"] == "X"}
    if args.first is not None and args.first not in steps:
        parser.error(f"--first {args.first}: the trace holds steps {min(steps)} to {max(steps)}")
    try:
        with cli.on_quit(files.drop_unfinished_writes):
            if plot(document, picture, args.steps, args.first):
                print(f"wrote {picture}")
    except TooMany as e:
        parser.error(str(e))
    except OSError as e:
        raise SystemExit(f"python -m multi_gpu.trace: error: cannot write {picture}: "
                         f"{e.strerror or e}") from None


if __name__ == "__main__":
    main()
