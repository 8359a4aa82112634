"""Statistics over runs, the table people read, and the JSON document ``schema.json`` describes.

"vs streamer" is a row's median time divided by streamer's at its default setting (streamer's
best when the default did not run): above 1 streamer is faster, below 1 the row is, the same
direction as the paired verdicts (peer's time over streamer's, per round).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from streamer_bench import stats
from streamer_bench.ceilings import Ceiling
from streamer_bench.loaders import INTO_SETTING, UNCHECKED_SETTING
from streamer_bench.runner import Config, Run
from streamer_bench.units import format_bytes, gbps

SCHEMA_ID = "streamer-bench/1"
GIB = 1 << 30
SCHEMA_PATH = Path(__file__).with_name("schema.json")  # JSON Schema of the --json document


def summarize(config: Config) -> dict[str, Any]:
    """One result object: the runs and their median, min, max, GB/s and peak RSS."""
    valid = [r for r in config.runs if r.valid and r.seconds is not None]
    seconds = [r.seconds for r in valid if r.seconds is not None]
    nbytes = max((r.bytes or 0 for r in valid), default=None)
    median = statistics.median(seconds) if seconds else None
    if valid:
        status = "ok"
    elif any(r.error and r.error.startswith("not ") for r in config.runs):
        status = "refused"  # the cache state could not be reached or verified
    else:
        status = "failed"
    rss = [r.peak_rss_bytes for r in valid if r.peak_rss_bytes is not None]
    faults = [r.minor_faults for r in valid if r.minor_faults is not None]
    cpu = [r.cpu_seconds for r in valid if r.cpu_seconds is not None]
    busy = [r.machine_busy_cores for r in valid if r.machine_busy_cores is not None]
    # The load's own cores, within the machine's: the two are counted apart (rusage, /proc/stat ticks).
    own = [
        min(r.cpu_seconds / r.load_seconds, r.machine_busy_cores or math.inf)
        for r in valid
        if r.cpu_seconds is not None and r.load_seconds
    ]
    stolen = [r.machine_stolen_cores for r in valid if r.machine_stolen_cores is not None]
    median_faults = statistics.median(faults) if faults else None
    return {
        "loader": config.setting.loader,
        "setting": config.setting.label,
        "knobs": dict(config.setting.knobs),
        "environment": config.setting.environment(),
        "status": status,
        "valid_runs": len(valid),
        "bytes": nbytes,
        "median_s": median,
        "min_s": min(seconds) if seconds else None,
        "max_s": max(seconds) if seconds else None,
        "gbps": gbps(nbytes, median) if median and nbytes else None,
        "ratio_vs_streamer": None,
        "peak_rss_bytes": int(statistics.median(rss)) if rss else None,
        "minor_faults": median_faults,
        "faults_per_gib": median_faults / (nbytes / GIB) if median_faults is not None and nbytes else None,
        "cpu_s": statistics.median(cpu) if cpu else None,
        "load_cores": statistics.median(own) if own else None,
        "machine_busy_cores": statistics.median(busy) if busy else None,
        "machine_stolen_cores": statistics.median(stolen) if stolen else None,
        "pruned": config.pruned,
        "retired": config.retired,
        "runs": [_run_json(r) for r in config.runs],
    }


def _run_json(run: Run) -> dict[str, Any]:
    return asdict(run)


def _reference(results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    ours = [r for r in results if r["loader"] == "streamer" and r["gbps"]]
    default = [r for r in ours if r["setting"] == "default"]
    return (default or sorted(ours, key=lambda r: r["median_s"]))[0] if ours else None


INTO_TOUCHED = INTO_SETTING.label  # streamer's load_into of touched tensors: the I/O path alone, not a load
UNCHECKED = UNCHECKED_SETTING.label  # streamer without a check it makes by default: its cost, not a peer


def _best_results(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each loader's result at its setting with the lowest median, in first-seen loader order
    (streamer's ``into=touched`` row is not a whole load, its ``crc32c=off`` row skips a check it
    makes by default, and a pruned setting stopped early: none counts as a best)."""
    best: dict[str, dict[str, Any]] = {}
    for r in results:
        if r["median_s"] is None or r["setting"] in (INTO_TOUCHED, UNCHECKED) or r.get("pruned"):
            continue
        current = best.get(r["loader"])
        if current is None or r["median_s"] < current["median_s"]:
            best[r["loader"]] = r
    return list(best.values())


_SUMMARY_KEYS = (
    "loader",
    "setting",
    "bytes",
    "median_s",
    "min_s",
    "max_s",
    "gbps",
    "ratio_vs_streamer",
    "peak_rss_bytes",
    "faults_per_gib",
    "cpu_s",
)


def _by_round(result: dict[str, Any], measure: str) -> dict[int, float]:
    """A run's ``measure`` (``seconds`` or ``cpu_seconds``) per round, for the valid runs that have it."""
    return {run["repeat"]: run[measure] for run in result["runs"] if run["valid"] and run[measure]}


def comparisons(reference: dict[str, Any], best: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamer's reference setting against each peer at its best setting, paired by round: wall
    seconds, and under ``cpu`` the CPU seconds, which show the work a storage-bound clock hides."""
    our_seconds, our_cpu = _by_round(reference, "seconds"), _by_round(reference, "cpu_seconds")
    out = []
    for peer in best:
        if peer["loader"] == "streamer":
            continue
        paired = asdict(stats.compare(our_seconds, _by_round(peer, "seconds")))
        cpu = asdict(stats.compare(our_cpu, _by_round(peer, "cpu_seconds")))
        out.append({"loader": peer["loader"], "setting": peer["setting"], **paired, "cpu": cpu})
    return out


def ceiling_pairs(results: Sequence[dict[str, Any]], ceilings: Sequence[Ceiling]) -> list[dict[str, Any]]:
    """Each streamer setting's GB/s over the read ceiling measured in the same round, paired by
    round (median and 95% interval): the disk's drift within the section cancels out of it."""
    measured = next((c for c in ceilings if c.rounds), None)
    if measured is None:
        return []
    per_byte = {entry["round"]: 1.0 / entry["gbps"] for entry in measured.rounds if entry["gbps"]}
    out = []
    for r in results:
        if r["loader"] != "streamer":
            continue
        ours = {run["repeat"]: run["seconds"] / run["bytes"] * 1e9 for run in r["runs"]
                if run["valid"] and run["seconds"] and run["bytes"]}  # fmt: skip
        paired = stats.compare(ours, per_byte)  # ceiling s/GB ÷ ours: our share of the ceiling
        ceiling = {"ceiling": measured.name, "jobs": measured.jobs}
        out.append({"setting": r["setting"], **ceiling, **asdict(paired)})
    return out


def undecided(state: str, configs: Sequence[Config]) -> set[str]:
    """The peers whose paired verdict in ``state`` is still open (neither ahead nor behind); for
    the others more rounds would only narrow intervals that already exclude 1."""
    comparisons = section(state, configs, [])["comparisons"]
    return {c["loader"] for c in comparisons if c["verdict"] not in ("ahead", "behind")}


def section(
    state: str,
    configs: Sequence[Config],
    ceilings: Sequence[Ceiling],
    first_touch_rounds: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """A cache-state section: every setting's result, each loader's best, the paired verdicts
    against each peer at its best, the read ceilings, fresh memory's rate before each round."""
    results = [summarize(c) for c in configs]
    reference = _reference(results)
    if reference is not None:
        for r in results:
            if r["gbps"]:
                r["ratio_vs_streamer"] = reference["gbps"] / r["gbps"]
    best = _best_results(results)
    return {
        "cache": state,
        "reference": {"loader": "streamer", "setting": reference["setting"]} if reference else None,
        "results": results,
        "best": [{k: r[k] for k in _SUMMARY_KEYS} for r in best],
        "comparisons": comparisons(reference, best) if reference is not None else [],
        "ceiling_pairs": ceiling_pairs(results, ceilings),
        "ceilings": [asdict(c) for c in ceilings],
        "first_touch_rounds": list(first_touch_rounds),
    }


# --- the table ---

_HEADER = (
    "loader",
    "setting",
    "median s",
    "min-max s",
    "GB/s",
    "vs streamer",
    "÷ ceiling",
    "peak RSS",
    "faults/GiB",
    "CPU s",
)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _row(r: dict[str, Any], ceiling: float | None) -> tuple[str, ...]:
    """One setting's row; ``ceiling``: the state's read ceiling in GB/s, for the "÷ ceiling" column."""
    if r.get("status", "ok") != "ok":
        first_error = next((run["error"] for run in r.get("runs", []) if run["error"]), "")
        return (r["loader"], r["setting"], r["status"].upper(), str(first_error)[:60], "", "", "", "", "", "")
    span = f"{r['min_s']:.3f}-{r['max_s']:.3f}"
    ratio = _fmt(r["ratio_vs_streamer"], ".2f") + ("x" if r["ratio_vs_streamer"] is not None else "")
    rss = format_bytes(r["peak_rss_bytes"]) if r["peak_rss_bytes"] is not None else "—"
    faults = _fmt(r["faults_per_gib"], ",.0f")
    cpu = _fmt(r["cpu_s"], ".2f")
    gbps_text = _fmt(r["gbps"], ".2f")
    of_ceiling = _fmt(r["gbps"] / ceiling if r["gbps"] and ceiling else None, ".2f")
    median = f"{r['median_s']:.3f}"
    return (r["loader"], r["setting"], median, span, gbps_text, ratio, of_ceiling, rss, faults, cpu)


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in (_HEADER, *rows)) for i in range(len(_HEADER))]
    numeric = set(range(2, len(_HEADER)))

    def line(row: tuple[str, ...]) -> str:
        cells = [
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(_HEADER), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)]


def _paired_text(c: dict[str, Any]) -> str:
    interval = f" [{c['low']:.2f}, {c['high']:.2f}]" if c["low"] is not None else ""
    return f"{c['ratio']:.2f}x{interval}"


def _comparison_line(c: dict[str, Any]) -> str:
    peer = f"{c['loader']} {c['setting']}"
    if c["ratio"] is None:
        return f"  {peer}: no round where both ran"
    rounds = f"{c['rounds']} round{'s' if c['rounds'] != 1 else ''}"
    line = f"  {peer}: {_paired_text(c)} over {rounds}: {c['verdict'].upper()}"
    cpu = c["cpu"]
    if cpu["ratio"] is not None:
        line += f" (CPU seconds {_paired_text(cpu)}: {cpu['verdict'].upper()})"
    if c["verdict"] == "not separable":  # which rounds held it open: often one the machine slowed
        line += "; per round: " + " ".join(f"{ratio:.2f}x" for ratio in c["per_round"])
    return line


def _ceiling_pair_line(p: dict[str, Any]) -> str:
    if p["ratio"] is None:
        return f"  streamer {p['setting']}: no round with both a load and a ceiling"
    rounds = f"{p['rounds']} round{'s' if p['rounds'] != 1 else ''}"
    return f"  streamer {p['setting']}: {_paired_text(p)} over {rounds}"


def _read_ceiling(section: dict[str, Any]) -> float | None:
    """The state's read ceiling: the best of its storage ceilings (fio, or the S3 ranged GETs)."""
    rates = [c["gbps"] for c in section["ceilings"] if c["gbps"]]
    return max(rates) if rates else None


_FAULTED_PATH = ("first_touch", "memcpy")  # fresh 4 KiB pages faulted in, then bytes copied into them
_FILLED_PATH = ("page_fill",)  # fresh pages created holding their bytes (streamer's page fill)


def _binding_ceiling(section: dict[str, Any], memory: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The lowest ceiling streamer's load in this state goes through: its read ceiling, then how its
    fresh memory came: the page fill where its runs say they filled pages, else first touch of fresh
    memory and memcpy. A ceiling streamer's reference load beat is not on its path (a load that
    beats first touch does not fault fresh 4 KiB pages in): it is listed as ``passed``, not named
    as the bound. The page fill the runs used stays on the path even if the load beat it: the
    ceiling is timed once, after the loads, and ran slower than them then. None before any
    ceiling is measured."""
    read = _read_ceiling(section)
    row = _reference_row(section)
    path = _FILLED_PATH if row is not None and _filled_pages(row) else _FAULTED_PATH
    found: list[tuple[float, str]] = [(read, "storage reads")] if read else []
    found += [(c["gbps"], c["name"]) for c in memory if c["name"] in path and c["gbps"]]
    if not found:
        return None
    ours = _reference_gbps(section)
    beaten = [item for item in found if ours is not None and item[0] < ours]
    passed = sorted(item for item in beaten if item[1] not in _FILLED_PATH)
    left = sorted(item for item in found if item not in passed)
    return {
        "name": left[0][1] if left else None,
        "gbps": left[0][0] if left else None,
        "passed": [{"name": name, "gbps": gbps} for gbps, name in passed],
    }


def _filled_pages(row: dict[str, Any]) -> bool:
    """Whether the row's runs created their buffers' pages with the page fill (metrics say "on")."""
    return any((run.get("metrics") or {}).get("page_fill") == "on" for run in row.get("runs", []))


def _reference_row(section: dict[str, Any]) -> dict[str, Any] | None:
    """The result of streamer's reference setting in this state, if it ran."""
    reference = section["reference"]
    if reference is None:
        return None
    rows = (
        r for r in section["results"] if r["loader"] == "streamer" and r["setting"] == reference["setting"]
    )
    return next(rows, None)


def _reference_gbps(section: dict[str, Any]) -> float | None:
    row = _reference_row(section)
    gbps: float | None = row.get("gbps") if row is not None else None
    return gbps


def _binding_line(cache: str, bound: dict[str, Any]) -> str:
    passed = ", ".join(f"{c['name']} at {c['gbps']:.2f} GB/s" for c in bound["passed"])
    them = "it" if len(bound["passed"]) == 1 else "them"
    beaten = f"; streamer beat {passed}, so its load does not go through {them}"
    if bound["name"] is None:
        return f"-- {cache}: above every measured ceiling{beaten if passed else ''}"
    return (
        f"-- {cache}: bound by {bound['name']} at {bound['gbps']:.2f} GB/s, the lowest ceiling streamer's "
        f"load passes through (÷ ceiling: GB/s over the read ceiling){beaten if passed else ''}"
    )


# Busy this much of every core on average, the machine had no CPU left for the load to grow into.
_CPU_BOUND_SHARE = 0.9
_SLOW_MEMORY_SHARE = 0.5  # a round whose first touch ran under this share of the median


def _cores_line(section: dict[str, Any], cpu_count: int | None) -> str | None:
    """What the machine's CPUs did while streamer's reference setting loaded (medians over its
    runs): busy in all, the load's own share, taken by the hypervisor; and whether they bound it."""
    row = _reference_row(section)
    if row is None or row.get("machine_busy_cores") is None or not cpu_count:
        return None
    busy, own, stolen = (
        row["machine_busy_cores"],
        row.get("load_cores"),
        row.get("machine_stolen_cores") or 0.0,
    )
    mine = f" ({own:.2f} of them the load's own)" if own is not None else ""
    bound = "; the CPUs bound the run" if busy + stolen >= _CPU_BOUND_SHARE * cpu_count else ""
    return (
        f"-- {section['cache']}: the machine's CPUs while streamer loaded: {busy:.2f} of {cpu_count} "
        f"busy{mine}, {stolen:.2f} taken by the hypervisor (medians){bound}"
    )


def _first_touch_line(section: dict[str, Any]) -> str | None:
    """Fresh memory's rate before each round, and the rounds it fell under half its median in:
    every load that faults fresh pages ran slower there, whatever the loader."""
    rounds = section.get("first_touch_rounds") or []
    if not rounds:
        return None
    rates = [float(r["gbps"]) for r in rounds]
    floor = _SLOW_MEMORY_SHARE * statistics.median(rates)
    slow = [str(r["round"] + 1) for r, rate in zip(rounds, rates, strict=True) if rate < floor]
    line = f"-- {section['cache']}: first touch of fresh memory before each round (GB/s): " + " ".join(
        f"{rate:.2f}" for rate in rates
    )
    if slow:
        line += f"; under half its median before round(s) {', '.join(slow)}: memory came slowly there"
    return line


def _ceiling_line(c: dict[str, Any]) -> str:
    value = f"{c['gbps']:.2f} GB/s" if c["gbps"] is not None else f"unavailable ({c['error']})"
    cache = f" ({c['cache']})" if c["cache"] else ""
    return f"  {c['name']}{cache}: {value} — {c['method']}, {c['detail']}".rstrip(", ")


_STATES = {  # each section's heading: what was true before every run
    "cold": "== cold cache: page cache evicted and verified empty (mincore) before every run",
    "warm": "== warm cache: files fully resident in the page cache (verified) before every run",
    "remote": "== remote: objects read from the store in every run; nothing on this machine to evict "
    "(the server side may cache)",
}


def render(document: dict[str, Any]) -> str:
    """The human-readable report."""
    ck = document["checkpoint"]
    opts = document["options"]
    s3 = document["machine"].get("s3")
    where = (
        f"S3 endpoint {s3['endpoint_host'] or 'AWS default'}"
        if s3
        else document["machine"]["filesystem"]["type"]
    )
    settle = opts.get("settle_seconds") or 0
    settled = f", started {settle:g} s after its files were ready (this VM gives freed memory to its host)"
    out = [
        f"streamer-bench: {len(ck['files'])} file(s), {format_bytes(ck['tensor_bytes'])} of tensors "
        f"({ck['tensor_count']} tensors), device {opts['device']}, {opts['repeat']} run(s) per setting, "
        f"interleaved; each run in a fresh process{settled if settle else ''}",
        f"source: {ck['source']} ({where})",
    ]
    stopped = document.get("interrupted")
    if stopped:
        out.append(
            f"INTERRUPTED by {stopped['signal']} during the {stopped['during']}: "
            "every figure below comes from the runs that finished before it"
        )
    for sec in document["sections"]:
        ceiling = _read_ceiling(sec)
        out += ["", _STATES[sec["cache"]], *_table([_row(r, ceiling) for r in sec["results"]])]
        if sec["best"]:
            out += [
                "",
                f"-- {sec['cache']}: each loader at its best setting (lowest median)",
                *_table([_row(r, ceiling) for r in sec["best"]]),
            ]
        if sec.get("comparisons"):
            ref = sec["reference"]["setting"]
            out += [
                "",
                f"-- {sec['cache']}: streamer {ref} vs each peer at its best, paired by round "
                "(peer time ÷ streamer time: above 1, streamer is faster; 95% bootstrap interval; "
                "CPU seconds paired the same way: above 1, streamer used less)",
                *(_comparison_line(c) for c in sec["comparisons"]),
            ]
        if sec.get("ceiling_pairs"):
            first = sec["ceiling_pairs"][0]
            out += [
                f"-- {sec['cache']}: streamer ÷ read ceiling, paired by round (GB/s over "
                f"{first['ceiling']} at {first['jobs']} job(s), measured again before each round's "
                "loads; 95% bootstrap interval)",
                *(_ceiling_pair_line(p) for p in sec["ceiling_pairs"]),
            ]
        bound = _binding_ceiling(sec, document["memory_ceilings"])
        if bound is not None:
            out.append(_binding_line(sec["cache"], bound))
        cores = _cores_line(sec, document["machine"].get("cpu_count"))
        if cores is not None:
            out.append(cores)
        touch = _first_touch_line(sec)
        if touch is not None:
            out.append(touch)
        for r in sec["results"]:
            for why in (r.get("pruned"), r.get("retired")):
                if why:
                    out.append(f"-- {sec['cache']}: {r['loader']} {r['setting']}: {why}")
        if sec.get("stopped"):
            out.append(f"-- {sec['cache']}: stopped: {sec['stopped']}")
        if sec["ceilings"]:
            what = (
                "store ceiling (the store's own parallel reads through the same endpoint: boto3's "
                "ranged GETs for S3, the SDK's for GCS and Azure; its best setting)"
                if sec["cache"] == "remote"
                else "storage ceilings (sequential read of the same files, best median of 2..8 jobs)"
            )
            out += ["", f"-- {sec['cache']}: {what}", *(_ceiling_line(c) for c in sec["ceilings"])]
    if document["memory_ceilings"]:
        out += ["", "-- memory ceilings"] + [_ceiling_line(c) for c in document["memory_ceilings"]]
    for s in document["skipped"]:
        out.append(
            f"skipped {s['loader']}: {s['reason']}" + (f" (install: {s['install']})" if s["install"] else "")
        )
    ref = next((s["reference"] for s in document["sections"] if s["reference"]), None)
    if ref:
        out += [
            "",
            f"vs streamer = row median s ÷ streamer {ref['setting']} median s (above 1: streamer faster, "
            "as in the verdicts).",
        ]
    return "\n".join(out)
