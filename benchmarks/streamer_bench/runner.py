"""Interleaved timed runs (A B C A B C …), each in a fresh child, each after the cache state
it claims was reached and verified ("remote" for S3 sources: nothing on this machine to reach)."""

from __future__ import annotations

import contextlib
import importlib.machinery
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from streamer.host.machine import free_page_reporting
from streamer_bench import pagecache
from streamer_bench.child import RESULT_MARK
from streamer_bench.loaders import CONTROLLED_ENV, Setting
from streamer_bench.units import format_bytes, gbps


def _package_roots() -> list[str]:
    """Where children import from: the directory holding this ``streamer_bench``, and the one holding
    the installed ``streamer``, found on the path without the working directory (from a checkout's
    root that is the source tree, whose ``streamer/`` has no built engine)."""
    roots = [str(Path(__file__).resolve().parents[1])]
    search = [entry for entry in sys.path if entry not in ("", os.getcwd())]
    spec = importlib.machinery.PathFinder.find_spec("streamer", search)
    if spec is not None and spec.origin is not None:
        installed = str(Path(spec.origin).resolve().parents[1])
        if installed not in roots:
            roots.append(installed)
    return roots


T = TypeVar("T")


class ChildFailed(Exception):
    """The child exited without a result line (crash, kill, timeout)."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived mid-run: the caller reports the runs that finished."""

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum).name
        self.exit_status = 128 + signum  # what the shell reports for a process the signal ended
        self.during = ""  # what it cut short, named by whoever catches it
        super().__init__(self.signal)


class _Stop:
    """The signal ``stopping_on_signals`` holds back while a child is being started: raised then,
    ``Interrupted`` would leave ``subprocess.Popen`` without a handle on the child it made (it runs
    on, orphaned); ``call_child`` raises it once the child is in hand, and kills the child."""

    spawning = False
    pending: int | None = None


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Within, the first SIGINT or SIGTERM raises ``Interrupted`` in the main thread, so a run cut
    by Ctrl-C or ``timeout`` still reports what it measured; the child in flight is killed
    (``call_child``). A second signal ends the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def stop(signum: int, frame: object) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        if _Stop.spawning:
            _Stop.pending = signum
            return
        raise Interrupted(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    _Stop.pending = None
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def child_env(extra: dict[str, str], *, own_package: bool = True) -> dict[str, str]:
    """The parent's environment minus the knobs a setting controls, plus that setting's own.

    ``own_package`` puts this bench and the installed streamer first on the child's path; a
    baseline interpreter keeps the streamer it has installed instead.
    """
    env = {k: v for k, v in os.environ.items() if k not in CONTROLLED_ENV}
    if own_package:
        env["PYTHONPATH"] = os.pathsep.join([*_package_roots(), *filter(None, [env.get("PYTHONPATH")])])
    else:
        env.pop("PYTHONPATH", None)
    return env | extra


# The start of every ``python -c`` a child runs: the working directory off the path (``-m`` and
# ``-c`` put it first, and from a checkout's root that is the source tree, with no built engine,
# not the streamer ``child_env`` chose).
CWD_OFF_PATH = "import sys; del sys.path[0]; "
# The child leaves with os._exit once its result is printed: tearing down an interpreter that
# imported torch took ~0.6 s a run here, and the next run's settle cannot start before it ends.
_RUN_CHILD = CWD_OFF_PATH + (
    "import os; from streamer_bench.child import main; code = main(sys.argv); "
    "sys.stdout.flush(); sys.stderr.flush(); os._exit(code)"
)


def call_child(
    request: dict[str, Any],
    env: dict[str, str] | None = None,
    timeout: float = 1800,
    python: str | None = None,
) -> dict[str, Any]:
    """Runs ``streamer_bench.child`` with ``request`` in ``python`` (default: this interpreter);
    returns its result object."""
    _Stop.spawning = True
    try:
        proc = subprocess.Popen(
            [python or sys.executable, "-c", _RUN_CHILD, json.dumps(request)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or child_env({}),
        )
    except BaseException:
        _Stop.spawning = False
        raise
    try:
        _Stop.spawning = False
        if _Stop.pending is not None:
            raise Interrupted(_Stop.pending)
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise ChildFailed(f"no result after {timeout:.0f} s (killed)") from None
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            result: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
            return result
    tail = (stderr or stdout).strip().splitlines()[-5:]
    raise ChildFailed(f"exit status {proc.returncode}: " + " | ".join(tail))


@dataclass
class Run:
    """One timed load (or the reason there is none)."""

    repeat: int
    valid: bool
    seconds: float | None = None
    bytes: int | None = None
    tensors: int | None = None
    peak_rss_bytes: int | None = None
    resident_before_bytes: int | None = None  # verified by the parent right before the child started
    resident_at_start_bytes: int | None = None  # re-established and re-read by the child before its clock
    metrics: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    minor_faults: int | None = None  # page faults inside the clock: first touch of fresh memory
    cpu_seconds: float | None = None  # user + system CPU inside the clock, every thread
    machine_busy_cores: float | None = None  # the whole machine's busy cores inside the load clock
    machine_stolen_cores: float | None = None  # cores the hypervisor took meanwhile
    load_seconds: float | None = None  # the load clock: from calling the loader to the tensors
    process_seconds: float | None = None  # the process clock: from the child's start, imports included


@dataclass
class Config:
    """One loader setting and the files (paths or S3 URIs) it reads (tensorizer reads its
    converted copy)."""

    setting: Setting
    files: list[str]
    source: str
    runs: list[Run] = field(default_factory=list)
    pruned: str | None = None  # why it stopped running before the state ended (``prune``)
    retired: str | None = None  # why it stopped once its verdict was decided (``retire``)

    @property
    def running(self) -> bool:
        """Whether this setting still runs in the state's next round."""
        return self.pruned is None and self.retired is None

    @property
    def paths(self) -> list[Path]:
        return [Path(f) for f in self.files]

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)


# Free page reporting hands a free 2 MiB block back to the host 2 s after it is freed
# (the kernel's PAGE_REPORTING_DELAY); a second more covers the report itself.
DEFAULT_SETTLE = 3.0


def default_settle() -> float:
    """Seconds between runs: ``DEFAULT_SETTLE`` on a VM with free page reporting, else none."""
    return DEFAULT_SETTLE if free_page_reporting() else 0.0


def _prepare(config: Config, state: str) -> tuple[int | None, str | None]:
    """Reaches ``state`` for the config's files: (resident bytes, reason it failed or None)."""
    if state == "remote":  # S3: no page cache on this side to empty or fill
        return None, None
    if state == "cold":
        resident = pagecache.make_cold(config.paths)
        return resident, (f"not cold: {resident} bytes still resident after eviction" if resident else None)
    missing = pagecache.make_warm(config.paths)
    resident = config.file_bytes - missing
    return resident, (f"not warm: {missing} bytes not resident after reading the files" if missing else None)


def _check_start(run: Run, state: str, config: Config) -> None:
    """A run whose child saw the wrong cache state at its clock's start does not count."""
    seen = run.resident_at_start_bytes
    if seen is None:
        return
    if state == "cold" and seen != 0:
        run.valid, run.error = False, f"not cold at the start of the clock: {seen} bytes resident"
    if state == "warm" and seen < (file_bytes := config.file_bytes):
        run.valid, run.error = False, f"not warm at the start of the clock: {file_bytes - seen} bytes missing"


PRUNE_MARGIN = 1.4  # a peer setting this much slower than its loader's best is not its best


def prune(configs: Sequence[Config], rounds: int) -> list[Config]:
    """Marks (``Config.pruned``) and returns the peer settings whose median after ``rounds``
    rounds is over ``PRUNE_MARGIN`` times the best of their loader's other settings: they would
    not be the loader's best, and the verdicts compare each peer at its best. streamer's settings
    and a loader's only setting always run."""
    medians: dict[int, float] = {}
    for config in configs:
        seconds = [run.seconds for run in config.runs if run.valid and run.seconds is not None]
        if seconds:
            medians[id(config)] = statistics.median(seconds)
    dropped = []
    for config in configs:
        loader = config.setting.loader
        others = [medians[id(c)] for c in configs if c.setting.loader == loader and c is not config
                  and id(c) in medians]  # fmt: skip
        mine = medians.get(id(config))
        if loader in ("streamer", "baseline") or mine is None or not others or not config.running:
            continue
        if mine > PRUNE_MARGIN * min(others):
            config.pruned = (
                f"not run after round {rounds}: {mine / min(others):.2f}x its loader's best so far "
                "(--no-prune runs every setting every round)"
            )
            dropped.append(config)
    return dropped


def retire(configs: Sequence[Config], undecided: set[str], rounds: int) -> list[Config]:
    """Marks (``Config.retired``) and returns the running peer settings whose loader's verdict is
    decided after ``rounds`` rounds: its interval already excludes 1, so the rounds left go to the
    verdicts still open. A retired setting stays its loader's best, judged on the rounds it ran."""
    peers = [c for c in configs if c.running and c.setting.loader != "streamer"]
    done = [c for c in peers if c.setting.loader not in undecided]
    for config in done:
        config.retired = (
            f"not run after round {rounds}: its verdict was decided "
            "(--min-rounds equal to --repeat runs every setting every round)"
        )
    return done


def round_order(configs: Sequence[T], round_index: int) -> list[T]:
    """Round 0 as given (the first figures come in the order the table lists); later rounds
    shuffled (a fixed rotation would put each setting after the same one every round)."""
    order = list(configs)
    if round_index > 0:
        random.Random(round_index).shuffle(order)
    return order


@dataclass(frozen=True)
class TimeBudget:
    """When the bench should be done (``clock()`` seconds), and what the cache states after the
    current one need at least: ``later_runs`` runs (their minimum rounds, weighted by what one costs
    against a run of the current state) and ``later_seconds`` (their ceilings). A state past its
    minimum rounds starts another only if it fits."""

    end: float
    later_runs: float = 0.0
    later_seconds: float = 0.0
    clock: Callable[[], float] = time.monotonic

    def fits(self, next_round: float, per_run: float) -> bool:
        """Whether a round of ``next_round`` seconds, then the later states at ``per_run`` seconds
        a run, end by ``end``."""
        return self.clock() + next_round + self.later_runs * per_run + self.later_seconds <= self.end


def run_section(
    configs: Sequence[Config],
    state: str,
    repeat: int,
    *,
    device: str,
    streamer_api: str,
    timeout: float,
    progress: Callable[[str], None],
    clock: str = "load",
    settle: float = 0.0,
    min_rounds: int | None = None,
    undecided: Callable[[], set[str]] | None = None,
    prune_after: int | None = None,
    each_round: Callable[[int], None] | None = None,
    budget: TimeBudget | None = None,
) -> str:
    """Up to ``repeat`` rounds over every config in ``state`` (cold, warm or remote): the first round in
    the given order, each later one shuffled (seeded, so reproducible). A run pays for the memory
    the run before it freed (on VMs that hand free pages back to the host, by up to 4x), so no
    setting may always follow the same neighbour, and each run starts ``settle`` seconds after the
    files reached ``state``: long enough for such a VM to have handed back what the last run freed,
    so every run meets memory as a server starting on an idle node does (with the load clock the
    child starts at once and waits out the settle after its imports, before the clock). ``clock`` (load or
    process) says which of the child's two times is the run's ``seconds``; both are kept.

    Adaptive: after ``min_rounds`` rounds (and each round after), the state ends as soon as
    ``undecided()`` (the peers whose verdict is still open) is empty, and a peer whose verdict is
    decided stops running (``retire``); after ``prune_after`` rounds, the peer settings far from
    their loader's best stop running (``prune``). ``each_round(r)`` runs before round ``r``'s loads
    (a read ceiling measured again, for ratios paired by round). With a ``budget``, a state past
    ``min_rounds`` also ends when another round, at the mean length of its runs so far times the
    settings still running, would not fit. Returns why the state ended."""
    total = repeat * len(configs)
    n = 0
    started = budget.clock() if budget is not None else 0.0
    for r in range(repeat):
        if undecided is not None and min_rounds is not None and min_rounds <= r:
            still_open = undecided()
            if not still_open:
                return f"every verdict decided after {r} rounds (at least {min_rounds}, at most {repeat})"
            for config in retire(configs, still_open, r):
                progress(f"[{state}] {config.setting.loader} {config.setting.label}: {config.retired}")
        if r == prune_after:
            for config in prune(configs, r):
                progress(f"[{state}] {config.setting.loader} {config.setting.label}: {config.pruned}")
        running = [c for c in configs if c.running]
        total = n + (repeat - r) * len(running)
        if budget is not None and r >= (min_rounds or 1):
            per_run = (budget.clock() - started) / max(n, 1)
            if not budget.fits(per_run * len(running), per_run):
                return f"{r} rounds: another would not end within --time-budget" + _undecided(undecided)
        if each_round is not None:
            each_round(r)
        for config in round_order(running, r):
            n += 1
            label = f"{config.setting.loader} {config.setting.label}"
            resident, problem = _prepare(config, state)
            if problem is not None:
                config.runs.append(Run(r, False, resident_before_bytes=resident, error=problem))
                progress(f"[{state} {n}/{total}] {label}: refused, {problem}")
                continue
            # The load clock leaves the child's start-up (interpreter, imports: ~1.3 s) out, so the
            # child spends it inside the settle and waits out the rest itself; the process clock
            # times it (and a --baseline install's child may not wait), so there the settle passes
            # before the child starts.
            settled = time.monotonic() + settle
            if clock == "process" or config.setting.python is not None:
                time.sleep(settle)
            request = {
                "action": "load",
                "settle_until": settled,
                "loader": config.setting.child_loader,
                "knobs": dict(config.setting.knobs),
                "files": config.files,
                "source": config.source,
                "device": device,
                "streamer_api": streamer_api,
                "cache": None if state == "remote" else state,
            }
            try:
                setting = config.setting
                env = child_env(setting.environment(), own_package=setting.python is None)
                result = call_child(request, env, timeout, setting.python)
            except ChildFailed as exc:
                result = {"ok": False, "error": str(exc)}
            if not result["ok"]:
                run = Run(r, False, resident_before_bytes=resident, error=result["error"])
            else:
                run = Run(
                    r,
                    True,
                    result["process_seconds" if clock == "process" else "seconds"],
                    result["bytes"],
                    result["tensors"],
                    result["peak_rss_bytes"],
                    resident,
                    result["resident_at_start_bytes"],
                    result["metrics"],
                    result["notes"],
                    minor_faults=result["minor_faults"],
                    cpu_seconds=result["cpu_seconds"],
                    machine_busy_cores=result.get("machine_busy_cores"),
                    machine_stolen_cores=result.get("machine_stolen_cores"),
                    load_seconds=result["seconds"],
                    process_seconds=result["process_seconds"],
                )
                _check_start(run, state, config)
            config.runs.append(run)
            if run.valid and run.seconds is not None and run.bytes is not None:
                rate = gbps(run.bytes, run.seconds)
                progress(
                    f"[{state} {n}/{total}] {label}: {run.seconds:.3f} s, {rate:.2f} GB/s, "
                    f"{format_bytes(run.bytes)}, {run.minor_faults} faults, {run.cpu_seconds:.2f} CPU s"
                )
            else:
                progress(f"[{state} {n}/{total}] {label}: FAILED {run.error}")
    return f"{repeat} rounds, the most asked for (--repeat)" + _undecided(undecided)


def _undecided(undecided: Callable[[], set[str]] | None) -> str:
    """What a state's stop reason adds when it ended with a verdict still undecided."""
    return "; some verdicts undecided" if undecided is not None and undecided() else ""
