"""The ratios, docs/bench/NAME.md and NAME.png of ``python -m bench.revisions`` (bench/report.py
writes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import fmt, pyplot, save

PATH = ("gateway", "worker", "redis")
WHAT = {
    "oneshot": "one-shot requests, no API key",
    "keyed": "one-shot requests with a key that has limits and a weight",
    "paced": "paced streams",
    "burst": "a burst of streams",
}
ENGINE = "engine alone"


def path_us(f: dict[str, Any]) -> int:
    """CPU per request of the gateway, the worker and Redis together."""
    return sum(f["cpu_us_per_request"][p] for p in PATH)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(side: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """``side``'s figures over ``base``'s: rate, CPU per request of each process, the path."""
    cpu, base_cpu = side["cpu_us_per_request"], base["cpu_us_per_request"]
    out = {"rate": _ratio(side["rate"], base["rate"])}
    out |= {p: _ratio(cpu[p], base_cpu[p]) for p in PATH}
    out["path"] = _ratio(path_us(side), path_us(base))
    return out


def add_ratios(workload: dict[str, Any], baseline: str) -> None:
    """Each side against the baseline revision: over every round, and round by round (a
    turn against the baseline's turn of the same round)."""
    base = workload["sides"].get(baseline)
    if base is None:
        return
    for label, side in workload["sides"].items():
        if label == baseline:
            continue
        side["vs_baseline"] = ratios(side, base)
        side["vs_baseline_per_round"] = [
            ratios(r[label], r[baseline])
            for r in workload["rounds"]
            if label in r and baseline in r
        ]


def add_keyed_ratio(results: dict[str, Any]) -> None:
    """A key's one-shot request against an anonymous one on the same revision (its path's
    CPU per request)."""
    keyed, anonymous = (results["workloads"].get(w) for w in ("keyed", "oneshot"))
    if keyed is None or anonymous is None:
        return
    for label, side in keyed["sides"].items():
        if label in anonymous["sides"]:
            side["vs_anonymous"] = _ratio(path_us(side), path_us(anonymous["sides"][label]))


def line(f: dict[str, Any]) -> str:
    """One turn's figures in a line (the bench's progress)."""
    cpu = f["cpu_us_per_request"]
    added = (
        f" added p99 {fmt(f['added_ttft_p99_ms'], 1, True)} ms" if "added_ttft_p99_ms" in f else ""
    )
    return (
        f"{fmt(f['rate'], 0)}/s ({fmt(f['vs_engine'], 2)} of the engine), TTFT p99"
        f" {fmt(f['ttft_p99_ms'], 1)} ms{added}, CPU us/request gateway {cpu['gateway']:,}"
        f" worker {cpu['worker']:,} Redis {cpu['redis']:,}, failed {f['failed']}"
    )


def _row(label: str, f: dict[str, Any], streamed: bool, baseline: str) -> str:
    cpu = f["cpu_us_per_request"]
    vs = f.get("vs_baseline")
    versus = "baseline" if label == baseline else "-"
    if vs is not None:
        versus = " / ".join(fmt(vs[k], 2) for k in ("rate", *PATH))
    added = ""
    if streamed:
        added = (
            f" {fmt(f['added_ttft_p50_ms'], 1, True)} / {fmt(f['added_ttft_p99_ms'], 1, True)} |"
        )
    keyed = f" {fmt(f['vs_anonymous'], 2)} |" if "vs_anonymous" in f else ""
    return (
        f"| {label} | {fmt(f['rate'], 0)} | {fmt(f['vs_engine'], 2)} |"
        f" {fmt(f['ttft_p50_ms'], 1)} / {fmt(f['ttft_p99_ms'], 1)} |{added}"
        f" {cpu['gateway']:,} / {cpu['worker']:,} / {cpu['redis']:,} | {path_us(f):,} |"
        f" {fmt(f['redis_calls_per_request'], 1)} | {versus} |{keyed} {f['failed']} |"
    )


def table(name: str, workload: dict[str, Any], baseline: str) -> list[str]:
    streamed = name in ("paced", "burst")
    keyed = any("vs_anonymous" in f for f in workload["sides"].values())
    unit = "tokens/s" if streamed else "requests/s"
    head = f"| side | {unit} | vs engine alone | TTFT p50 / p99 ms |"
    head += " added TTFT p50 / p99 ms |" if streamed else ""
    head += " CPU us per request: gateway / worker / Redis | path us |"
    head += " Redis calls per request | vs baseline: rate / gateway / worker / Redis |"
    head += " path vs anonymous |" if keyed else ""
    head += " failed |"
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    rows += [_row(label, f, streamed, baseline) for label, f in workload["sides"].items()]
    alone = workload["engine"]
    rows.append(
        f"| {ENGINE} | {fmt(alone['rate'], 0)} | 1.00 |"
        f" {fmt(alone['ttft_p50_ms'], 1)} / {fmt(alone['ttft_p99_ms'], 1)} |"
        + (" |" if streamed else "")
        + f" engine {alone['cpu_us_per_request']['engine']:,} | | | |"
        + (" |" if keyed else "")
        + f" {alone['failed']} |"
    )
    return rows


def per_round(workload: dict[str, Any]) -> list[str]:
    out = []
    for label, f in workload["sides"].items():
        rounds = f.get("vs_baseline_per_round")
        if rounds:
            pairs = "; ".join(" / ".join(fmt(r[k], 2) for k in ("rate", *PATH)) for r in rounds)
            out.append(f"- {label}, round by round (rate / gateway / worker / Redis): {pairs}")
    return out


def lacking(workload: dict[str, Any]) -> list[str]:
    """A note for each side whose engine worker had none of the workload's engine flags
    (an older revision's: it ran without them, the engine alone with them)."""
    flags = workload.get("engine_flags", [])[::2]
    out = []
    for label, f in workload["sides"].items():
        missing = [flag for flag in flags if flag not in f["processes_from"]["worker_args"]]
        if missing:
            out.append(f"- {label}: its engine worker has no {', '.join(missing)}: ran without")
    return ["", *out] if out else []


def markdown(results: dict[str, Any]) -> str:
    s, m = results["settings"], results["machine"]
    revisions = ", ".join(f"{r['label']} `{r['commit'][:10]}`" for r in s["revisions"])
    out = [
        "# Revisions in turns (python -m bench.revisions)",
        "",
        f"Revisions: {revisions}; the first is the baseline. {s['rounds']} rounds, each"
        " revision in turn within each round, the order reversed every other round (A/B, B/A),"
        " the same client; pinned: the gateway"
        " on CPU 1, the worker, Redis, the engine alone and the client on CPU 0.",
        f"Machine: {m['cpu_model']}, {m['nproc']} CPUs, load {m['loadavg_at_start']} at"
        f" start. Suite {results['suite_s']} s.",
    ]
    shapes = {
        "oneshot": f"{s['requests']:,} requests of {s['tokens']} token(s) a turn,"
        f" {s['concurrency']} at a time, {s['connections']} connections, unpaced",
        "keyed": f"the same, with a key of weight {s['weight']:g} and every limit set",
        "paced": f"{s['streams']:,} streams of {s['stream_tokens']} tokens at {s['rate']:g}"
        f" tokens/s, started at {s['start_rate']:g}/s",
        "burst": f"{s['burst']:,} streams within {s['within_s']} s, {s['total_rate']:,.0f}"
        f" tokens/s in all, {s['burst_tokens']} tokens each, {s['prepare_cpu_ms']} ms prepare",
    }
    for name, workload in results["workloads"].items():
        baseline = s["revisions"][0]["label"]
        out += ["", f"## {WHAT[name]}", "", shapes[name] + ".", ""]
        out += table(name, workload, baseline)
        rounds = per_round(workload)
        out += ["", *rounds] if rounds else []
        out += lacking(workload)
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], png: Path) -> None:
    """Per workload, each side's CPU per request, stacked by process."""
    plt = pyplot()
    workloads = results["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 4), squeeze=False)
    for ax, (name, workload) in zip(axes[0], workloads.items(), strict=True):
        labels = list(workload["sides"])
        bottom = [0.0] * len(labels)
        for process in PATH:
            values = [workload["sides"][label]["cpu_us_per_request"][process] for label in labels]
            ax.bar(range(len(labels)), values, bottom=bottom, label=process)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xticks(range(len(labels)), [label.split(" (")[0] for label in labels], fontsize=8)
        ax.set_title(WHAT[name], fontsize=9)
        ax.set_ylabel("CPU us per request")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, png)
