"""``python -m bench.tracing_cost``: what tracing costs on the token path.

Three sides, in turns (the order reversed every other round), each a run of ``--bench``
(``e2e``: ``bench.e2e`` at ``--streams`` streams of 100 tokens, OpenAI streaming;
``requests``: ``bench.requests``, one-token requests on kept connections through one
gateway process) on a fresh rig:

- ``before``: the code before tracing (``--before DIR``: a checkout of that commit, e.g.
  ``git worktree add --detach DIR 158d592``; its bench run from there);
- ``off``: this code, tracing off (no OTLP endpoint: the default);
- ``on``: this code, tracing on, ``parentbased_traceidratio`` at ``--ratio`` (1 %),
  exporting over OTLP/HTTP to a receiver in this process, which counts what it gets.

Per side: each process's CPU per token (``e2e``) or per request (``requests``), the
median over the rounds and every round's, and the ratios off/before and on/off of the
path's (gateway + worker + Redis). Results: docs/bench/tracing-cost-BENCH.json and .md
(``--name``).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from bench import report
from bench.stats import machine

ROOT = Path(__file__).resolve().parent.parent
PATH = ("gateway", "worker", "redis")


def say(message: str) -> None:
    print(f"[bench.tracing_cost] {message}", file=sys.stderr, flush=True)


class SpanSink:
    """An OTLP/HTTP trace receiver that counts the spans it gets, by service."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        self.spans: dict[str, int] = {}
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers["content-length"])))
                for resource in request.resource_spans:
                    names = {a.key: a.value.string_value for a in resource.resource.attributes}
                    service = names.get("service.name", "")
                    count = sum(len(scope.spans) for scope in resource.scope_spans)
                    sink.spans[service] = sink.spans.get(service, 0) + count
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self) -> dict[str, int]:
        """The spans counted since the last take."""
        taken, self.spans = self.spans, {}
        return taken


def command(bench: str, out: Path, name: str, streams: int, requests: int) -> list[str]:
    if bench == "e2e":
        return [
            *("-m", "bench.e2e", "--streams", str(streams), "--modes", "engine", "openai"),
            *("--saturation", "0", "0", "--no-plot", "--out", str(out), "--name", name),
        ]
    return [
        *("-m", "bench.requests", "--requests", str(requests), "--rounds", "1"),
        *("--gateways", "1", "--connections", "kept", "--out", str(out), "--name", name),
    ]


def cpu_of(bench: str, results: dict[str, Any]) -> dict[str, float]:
    """The path's CPU per token (e2e, OpenAI) or per request (requests), us, by process."""
    if bench == "e2e":
        cpu = results["points"][-1]["modes"]["openai"]["cpu_us_per_token"]
    else:
        cpu = results["sides"]["gateway x1, kept"]["cpu_us_per_request"]
    return {name: float(cpu[name]) for name in PATH}


def one_turn(
    args: argparse.Namespace, side: str, round_index: int, sink: SpanSink, scratch: Path
) -> dict[str, Any]:
    tree = args.before if side == "before" else ROOT
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if side == "on":
        env |= {
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(args.ratio),
        }
    name = f"{args.bench}-{side}-{round_index}"
    say(f"round {round_index}: {side} ({tree})")
    sink.take()
    argv = command(args.bench, scratch, name, args.streams, args.requests)
    subprocess.run([sys.executable, *argv], cwd=tree, env=env, check=True)
    results = json.loads((scratch / f"{name}.json").read_text())
    cpu = cpu_of(args.bench, results)
    return {"side": side, "round": round_index, "cpu_us": cpu, "spans": sink.take()}


def summary(turns: list[dict[str, Any]], sides: list[str]) -> dict[str, Any]:
    """Per side, the median of each process's CPU and of the path's; the ratios."""
    medians: dict[str, dict[str, float]] = {}
    for side in sides:
        own = [t["cpu_us"] for t in turns if t["side"] == side]
        medians[side] = {p: round(statistics.median(c[p] for c in own), 1) for p in PATH}
        medians[side]["path"] = round(statistics.median(sum(c.values()) for c in own), 1)
    ratios = {}
    if "before" in medians:
        ratios["off / before"] = round(medians["off"]["path"] / medians["before"]["path"], 3)
    ratios["on / off"] = round(medians["on"]["path"] / medians["off"]["path"], 3)
    return {"median_cpu_us": medians, "ratios": ratios}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sides = (["before"] if args.before else []) + ["off", "on"]
    sink = SpanSink()
    scratch = Path(tempfile.mkdtemp(prefix="tokenspout-tracing-cost-"))
    turns = []
    for round_index in range(1, args.rounds + 1):
        order = sides if round_index % 2 else sides[::-1]
        turns += [one_turn(args, side, round_index, sink, scratch) for side in order]
    return {
        "machine": machine(),
        "settings": {
            "bench": args.bench,
            "streams": args.streams,
            "requests": args.requests,
            "rounds": args.rounds,
            "ratio": args.ratio,
            "before": str(args.before) if args.before else None,
        },
        "turns": turns,
        **summary(turns, sides),
    }


def markdown(results: dict[str, Any]) -> str:
    settings = results["settings"]
    unit = "token" if settings["bench"] == "e2e" else "request"
    what = (
        f"`bench.e2e --streams {settings['streams']}` (OpenAI streaming, 100 tokens a stream)"
        if settings["bench"] == "e2e"
        else f"`bench.requests` ({settings['requests']:,} one-token requests, kept connections, "
        "one gateway process)"
    )
    lines = [
        f"# What tracing costs: CPU per {unit}",
        "",
        f"`python -m bench.tracing_cost --bench {settings['bench']}`: {what}, "
        f"{settings['rounds']} rounds of the sides in turns; `before`: {settings['before']}; "
        f"`on`: a {settings['ratio']:.0%} sample exported over OTLP/HTTP. "
        f"Machine: {results['machine']['cpu_model']}, {results['machine']['nproc']} cores, "
        f"load average {results['machine']['loadavg_at_start'][0]} at the start.",
        "",
        f"| side | gateway | worker | Redis | path, us per {unit} |",
        "| --- | --- | --- | --- | --- |",
    ]
    for side, cpu in results["median_cpu_us"].items():
        row = " | ".join(report.fmt(cpu[p]) for p in (*PATH, "path"))
        lines.append(f"| {side} (median) | {row} |")
    lines += ["", "| ratio | path |", "| --- | --- |"]
    lines += [f"| {name} | {value:.3f} |" for name, value in results["ratios"].items()]
    lines += ["", "| round | side | gateway | worker | Redis | path | spans exported |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- |"]
    for turn in results["turns"]:
        cpu = turn["cpu_us"]
        spans = ", ".join(f"{k} {v:,}" for k, v in sorted(turn["spans"].items())) or "-"
        row = " | ".join(report.fmt(cpu[p]) for p in PATH)
        lines.append(
            f"| {turn['round']} | {turn['side']} | {row} | {report.fmt(sum(cpu.values()))} "
            f"| {spans} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_cost", description=__doc__)
    parser.add_argument("--bench", choices=["e2e", "requests"], default="e2e")
    parser.add_argument("--before", type=Path, default=None, help="a checkout of the base")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.01, help="the on side's sample")
    parser.add_argument("--streams", type=int, default=500, help="e2e: streams at once")
    parser.add_argument("--requests", type=int, default=1000, help="requests: per side")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--name", default=None, help="NAME.json, NAME.md (tracing-cost-BENCH)")
    args = parser.parse_args()
    results = measure(args)
    text = markdown(results)
    report.write(args.out, args.name or f"tracing-cost-{args.bench}", results, text)
    print(text)


if __name__ == "__main__":
    main()
