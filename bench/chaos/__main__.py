"""``python -m bench.chaos``: faults under load, every reply's whole history checked.

Two gateways, four synthetic workers of two models (``alpha``, ``beta``: its workers have
few slots and preempt, so replies are also stopped for tenants served less) and a Redis: one
server with AOF persistence (``--redis single``), one keeping nothing on disk
(``volatile``: not restarted), or 3 primaries and 3 replicas (``cluster``).
``--clients`` loops of mixed clients (bench/chaos/clients.py) keep it loaded while a
fault drawn from ``--seed`` strikes every 1 to 3 s (bench/chaos/faults.py). When the time
is up the faults stop, the clients finish their replies, and the checker
(bench/chaos/check.py) goes over each one; the engine must then be idle.

Prints progress every 10 s and a table at the end; writes the report (faults by kind,
replies and events checked, each anomaly with the seed and the time to replay it) to
``--out``. Exits 1 when it found an anomaly. ``make soak`` runs it ten minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from redis.exceptions import RedisError

from bench.chaos import adapters, check, clients, faults, usage
from bench.chaos.clients import Context, Record
from bench.chaos.fleet import MODELS, Fleet, fleet
from bench.chaos.redises import KINDS
from bench.chaos.tenants import ApiKey
from bench.stats import metrics_of
from stack.rig import sync_client

T = TypeVar("T")
BOUND_S = 90.0
"""Every reply ends within this, faults and all, not counting the time Redis took no writes
(else it hung)."""
IDLE_WITHIN_S = 30.0
CLIENT_MIX = {"sse": 4, "ws_cancel": 2, "openai": 3, "responses": 1, "tgi": 1, "oip": 1, "grpc": 1}
RUNNING = ("tokenspout_engine_running", "tokenspout_engine_generations_running")
PREEMPTIONS = "tokenspout_engine_preemptions_total"


class Run:
    """One chaos run: its clients, its faults, and what they found."""

    def __init__(self, seed: int, duration_s: float, fleet: Fleet, client_loops: int) -> None:
        self.seed = seed
        self.duration_s = duration_s
        self.fleet = fleet
        self.client_loops = client_loops
        self.ctx = Context(fleet.client_urls, fleet.now, fleet.grpc_urls, fleet.redis_away_s)
        self.records: list[Record] = []
        self.anomalies: list[dict[str, Any]] = []
        self.extra: set[asyncio.Task[None]] = set()
        self.usage: list[dict[str, Any]] = []
        """Per key: what Redis counted and what its clients received (bench/chaos/usage.py)."""
        self.checked_against_redis = 0
        """Replies compared with what Redis holds afterwards (those Redis lost writes
        since are not)."""
        self.preempted: dict[str, int] = {}
        """Per worker, the replies it stopped for another tenant, as last read: a worker
        killed or stopped keeps the count read before (``watch_preemptions``)."""

    def anomaly(self, at_s: float, label: str, what: str, trail: list[str] | None = None) -> None:
        near = [
            f"{f.at_s}s {f.kind} {f.target}"
            for f in self.fleet.faults
            if at_s - 10 <= f.at_s <= at_s + 30
        ][:8]
        self.anomalies.append(
            {
                "seed": self.seed,
                "at_s": round(at_s, 2),
                "client": label,
                "what": what,
                "faults_near": near,
                **({"trail": trail[-12:]} if trail else {}),
            }
        )
        print(f"[chaos] ANOMALY at {at_s:.1f} s (seed {self.seed}) {label}: {what}", flush=True)

    async def bounded(self, label: str, job: Callable[[], Awaitable[list[Record]]]) -> None:
        """Run a client's ``job``; an anomaly if it does not end within ``BOUND_S`` of
        the time Redis took writes (a failover with no primary yet, a restart, a pause
        hold every reply up, as they should) or fails."""
        started = self.fleet.now()
        running = asyncio.ensure_future(job())
        while not running.done():
            now = self.fleet.now()
            left_s = started + BOUND_S + self.fleet.redis_away_s(started, now) - now
            if left_s <= 0:
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
                what = f"no end within {BOUND_S:.0f} s while Redis took writes (hung)"
                self.anomaly(started, label, f"{what}: {self.state_of(label)}")
                return
            await asyncio.wait([running], timeout=left_s)
        try:
            self.records.extend(running.result())
        except TimeoutError:  # a timeout of the client's own: it gave up, which is no hang
            self.anomaly(started, label, f"client gave up (timeout): {self.state_of(label)}")
        except Exception as exc:
            detail = "".join(traceback.format_exception_only(exc)).strip()
            where = traceback.extract_tb(exc.__traceback__)[-1]
            at = f"{Path(where.filename).name}:{where.lineno} ({where.name})"
            self.anomaly(started, label, f"client failed at {at}: {detail}")

    def state_of(self, label: str) -> str:
        """What a hung client's replies had got, and what Redis holds of their generation."""
        states = []
        for record in (r for name, r in self.ctx.open.items() if name.startswith(label)):
            held: dict[str, str] = {}
            if record.session is not None and record.generation_id is not None:
                key = self.fleet.keys.generation(record.session[0], record.generation_id)
                try:
                    with sync_client(self.fleet.rig.redis_url) as client:
                        held = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
                except RedisError as exc:  # Redis away (a failover under way): say so
                    held = {"unread": f"{type(exc).__name__}: {exc}"}
            states.append(
                f"{record.kind} {record.label} session={record.session and record.session[0]} "
                f"generation={record.generation_id} final={record.final} "
                f"events={[e for _, e, _ in record.events[-6:]]} ({len(record.events)}) "
                f"reconnects={record.reconnects} retries={record.retries} "
                f"problems={record.problems} redis={held} trail={record.trail[-12:]}"
            )
        return "; ".join(states) or "no reply begun"

    def one_client(
        self, rng: random.Random, label: str, key: ApiKey
    ) -> Callable[[], Awaitable[list[Record]]]:
        kind = rng.choices(list(CLIENT_MIX), weights=list(CLIENT_MIX.values()))[0]
        model = rng.choice(MODELS)
        ctx, faults_on = self.ctx, self.fleet.faults_on

        async def job() -> list[Record]:
            if kind == "sse":
                return await clients.session_reader(ctx, rng, label, model, key, slow=False)
            if kind == "ws_cancel":
                return [await clients.ws_canceller(ctx, rng, label, model, key)]
            if kind == "openai":
                return [await adapters.openai_client(ctx, rng, label, model, key, faults_on)]
            if kind == "tgi":  # TGI names no model: the default one's
                return [await adapters.tgi_client(ctx, rng, label, key, MODELS[0], faults_on)]
            if kind == "oip":
                return [await adapters.oip_client(ctx, rng, label, key, model, faults_on)]
            if kind == "grpc":
                return [await adapters.grpc_client(ctx, rng, label, model, key, faults_on)]
            return [await adapters.responses_reader(ctx, rng, label, model, key, faults_on)]

        return job

    async def client_loop(self, index: int) -> None:
        """Replies one after another, all with the key of ``index`` (modulo the keys)."""
        rng = random.Random(f"client-{self.seed}-{index}")
        key = self.fleet.api_keys[index % len(self.fleet.api_keys)]
        count = 0
        while self.fleet.now() < self.duration_s:
            label = f"c{index}.{count}"
            await self.bounded(label, self.one_client(rng, label, key))
            count += 1

    async def fire(self, planned: faults.Planned) -> None:
        fleet, kind, cut = self.fleet, planned.kind, planned.cut
        try:
            if cut is not None and kind.startswith("worker_"):
                worker = await self.target(lambda: fleet.worker_target(planned.pick))
                await fleet.cut_worker(worker, cut)
            elif cut is not None and kind.startswith("gateway_"):
                port = await self.target(lambda: fleet.gateway_target(planned.pick))
                await fleet.cut_gateway(port, cut)
            elif cut is not None:
                port = fleet.gateway_ports[planned.pick % len(fleet.gateway_ports)]
                await fleet.cut_clients(port, cut, planned.share)
            elif kind.startswith("worker_"):
                worker = await self.target(lambda: fleet.worker_target(planned.pick))
                await fleet.signal_worker(worker, kind[7:], planned.held_s)
            elif kind == "gateway_process_kill":
                port, pid = await self.target(lambda: fleet.gateway_process_target(planned.pick))
                fleet.kill_gateway_process(port, pid)
            elif kind.startswith("gateway_"):
                port = await self.target(lambda: fleet.gateway_target(planned.pick))
                await fleet.signal_gateway(port, kind[8:], planned.held_s)
            elif kind in ("redis_restart", "redis_crash", "redis_wipe"):
                await fleet.redis_down(kind[6:], planned.held_s)
            elif kind == "redis_pause":
                await fleet.pause_redis(planned.held_s)
            elif kind == "redis_full":
                await fleet.fill_redis(planned.held_s)
            elif kind in ("primary_kill", "sentinel_failover"):
                await fleet.fail_over(planned.pick)
            elif kind == "slow_readers":
                self.slow_readers(planned)
            elif kind == "hostile_burst":
                rng = random.Random(f"{self.seed}-burst-{planned.at_s}")
                for problem in await faults.hostile_burst(self.ctx, fleet, rng):
                    self.anomaly(fleet.now(), "hostile_burst", problem)
        except Exception as exc:
            self.anomaly(fleet.now(), f"fault {kind}", f"injecting it failed: {exc!r}")

    def slow_readers(self, planned: faults.Planned) -> None:
        self.fleet.note("slow_readers", "2 readers")
        for n in range(2):
            label = f"slow{planned.at_s}.{n}"
            rng = random.Random(f"{self.seed}-{label}")
            key = rng.choice(self.fleet.api_keys)

            async def slow(
                rng: random.Random = rng, label: str = label, key: ApiKey = key
            ) -> list[Record]:
                return await clients.session_reader(
                    self.ctx, rng, label, rng.choice(MODELS), key, slow=True
                )

            self.spawn(self.bounded(label, slow))

    @staticmethod
    async def target(pick: Callable[[], T | None]) -> T:
        """The process a fault strikes: one no other fault holds now (waits for one)."""
        async with asyncio.timeout(30):
            while (found := pick()) is None:
                await asyncio.sleep(0.2)
        return found

    def spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self.extra.add(task)
        task.add_done_callback(self.extra.discard)

    async def inject(self) -> None:
        for planned in faults.schedule(self.seed, self.fleet.redis_kind, self.duration_s):
            await asyncio.sleep(max(0.0, planned.at_s - self.fleet.now()))
            self.spawn(self.fire(planned))

    async def progress(self) -> None:
        while True:
            await asyncio.sleep(10)
            print(
                f"[chaos] {self.fleet.now():5.0f} s: {len(self.fleet.faults)} faults, "
                f"{len(self.records)} replies, {len(self.anomalies)} anomalies",
                flush=True,
            )

    async def watch_preemptions(self) -> None:
        """Each live worker's preemptions, read every second through the run: the faults
        kill the workers that preempt too, and their counters with them."""
        while True:
            for worker in self.fleet.live_workers():
                try:
                    async with asyncio.timeout(2):
                        samples = await metrics_of(worker.metrics_url, self.ctx.http)
                except (httpx.HTTPError, TimeoutError):
                    continue  # stopped, killed or starting: its last count stands
                self.preempted[worker.worker_id] = int(samples.get(PREEMPTIONS, 0))
            await asyncio.sleep(1)

    async def engine_idle(self) -> None:
        """Every worker's running gauges reach 0 once the clients are done: no orphan work."""
        deadline = time.monotonic() + IDLE_WITHIN_S
        busy: list[str] = []
        while time.monotonic() < deadline:
            busy = []
            for worker in self.fleet.live_workers():
                samples = await metrics_of(worker.metrics_url, self.ctx.http)
                if any(samples.get(name) for name in RUNNING):
                    busy.append(worker.worker_id)
                self.preempted[worker.worker_id] = int(samples.get(PREEMPTIONS, 0))
            if not busy:
                return
            await asyncio.sleep(0.5)
        self.anomaly(
            self.fleet.now(),
            "engine",
            f"still running work {IDLE_WITHIN_S:.0f} s after the load: {busy}",
        )

    async def check_all(self) -> None:
        by_session: dict[tuple[str, str], list[Record]] = collections.defaultdict(list)
        for record in self.records:
            for problem in check.check(record, self.fleet.losses, self.fleet.held_until):
                self.anomaly(record.started_s, record.label, problem, record.trail)
            if self.redis_lost_since(record):
                continue  # Redis may no longer hold what its client read: checked above only
            if record.session is not None and record.kind in ("sse", "sse_slow"):
                by_session[record.session].append(record)
            elif record.kind == "ws_cancel":
                self.checked_against_redis += 1
                for problem in await check.check_ws_against_redis(self.ctx, record):
                    self.anomaly(record.started_s, record.label, problem)
        for records in by_session.values():
            self.checked_against_redis += len(records)
            for problem in await check.check_against_redis(self.ctx, records):
                self.anomaly(records[0].started_s, records[0].label, problem)

    def redis_lost_since(self, record: Record) -> bool:
        """Redis lost writes since the record's session (or request) began."""
        return any(loss.at_s >= record.began_s - check.BEFORE_S for loss in self.fleet.losses)

    async def check_usage(self) -> None:
        """Each key's counted usage against what its clients received (bench/chaos/usage.py)."""
        fleet = self.fleet
        self.usage, findings = await usage.check_usage(
            self.ctx.http,
            gateway=fleet.gateway_urls[0],
            admin=fleet.admin,
            redis_url=fleet.rig.redis_url,
            keys=fleet.keys,
            api_keys=fleet.api_keys,
            records=self.records,
            started_ms=int(fleet.started_unix * 1000),
            cluster=fleet.redis_kind == "cluster",
            failovers=[f.at_s for f in fleet.faults if f.kind == "primary_kill"],
            losses=fleet.losses,
            end_s=fleet.now(),
        )
        for finding in findings:
            self.anomaly(finding.at_s, finding.label, finding.what)

    async def run(self) -> None:
        reporter = asyncio.create_task(self.progress())
        injector = asyncio.create_task(self.inject())
        preemptions = asyncio.create_task(self.watch_preemptions())
        try:
            await asyncio.gather(*(self.client_loop(i) for i in range(self.client_loops)))
            await injector
            self.fleet.resume_all()
            while self.extra:
                await asyncio.gather(*self.extra)
            await self.engine_idle()
            await self.check_all()
            await self.check_usage()
        finally:
            reporter.cancel()
            injector.cancel()
            preemptions.cancel()
            await self.ctx.close()
            await self.fleet.store.proxy.control.close()
            await self.fleet.client_proxy.control.close()

    def report(self) -> dict[str, Any]:
        by_kind = collections.Counter(f.kind for f in self.fleet.faults)
        replies = collections.Counter(r.kind for r in self.records)
        finals = collections.Counter(f"{r.kind}:{r.final}" for r in self.records)
        return {
            "seed": self.seed,
            "redis": self.fleet.redis_kind,
            "duration_s": self.duration_s,
            "client_loops": self.client_loops,
            "faults": len(self.fleet.faults),
            "faults_by_kind": dict(sorted(by_kind.items())),
            "replies": len(self.records),
            "replies_by_kind": dict(sorted(replies.items())),
            "finals": dict(sorted(finals.items())),
            "events": sum(len(r.events) for r in self.records),
            "takeovers_seen": sum(
                event == "resumed" for r in self.records for _, event, _ in r.events
            ),
            "preemptions": sum(self.preempted.values()),
            "reconnects": sum(r.reconnects for r in self.records),
            "retries": sum(r.retries for r in self.records),
            "interrupted": sum(r.interrupted is not None for r in self.records),
            "resent": sum(r.resent for r in self.records),
            "checked_against_redis": self.checked_against_redis,
            "losses": [vars(loss) for loss in self.fleet.losses],
            "told_lost": dict(
                sorted(collections.Counter(t.what for r in self.records for t in r.lost).items())
            ),
            "told_lost_after_s": max(
                (
                    check.told_after_s(told, causes[-1], self.fleet.held_until)
                    for r in self.records
                    for told in r.lost
                    if (causes := check.causes_of(r, told, self.fleet.losses))
                ),
                default=0.0,
            ),
            "usage": self.usage,
            "anomalies": self.anomalies,
            "fault_log": [vars(f) for f in self.fleet.faults],
        }


async def main(
    seed: int, duration_s: float, redis_kind: str, loops: int, logs: Path
) -> dict[str, Any]:
    print(
        f"[chaos] seed {seed}, {duration_s:.0f} s, redis {redis_kind}, {loops} client loops; "
        f"logs in {logs}",
        flush=True,
    )
    with fleet(redis_kind, logs) as the_fleet:
        print("[chaos] fleet up: 2 gateways, 4 workers; load and faults start", flush=True)
        run = Run(seed, duration_s, the_fleet, loops)
        await run.run()
        return run.report()


def table(report: dict[str, Any]) -> str:
    rows = [f"seed {report['seed']} ({report['redis']}, {report['duration_s']:.0f} s)"]
    rows += [f"  {kind:<16} {count}" for kind, count in report["faults_by_kind"].items()]
    rows.append(
        f"  faults {report['faults']}, replies {report['replies']}, events "
        f"{report['events']}, interrupted {report['interrupted']}, "
        f"anomalies {len(report['anomalies'])}"
    )
    for key in report["usage"]:
        counted, delivered = key["counted"], key["delivered"]
        rows.append(
            f"  key {key['name']:<14} counted {counted['prompt_tokens']}+"
            f"{counted['completion_tokens']} tokens in {counted['generations']} generations, "
            f"received {delivered['prompt_tokens']}+{delivered['completion_tokens']} in "
            f"{delivered['generations']} ({key['ended_unseen_by_clients']} ends no client saw, "
            f"{key['other_choices']} second choices, "
            f"{key['refused_by_limits']} refusals by its limits)"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=60)
    parser.add_argument("--redis", choices=KINDS, default="single")
    parser.add_argument("--clients", type=int, default=24, help="client loops at once")
    parser.add_argument("--out", type=Path, default=None, help="write the report (JSON) here")
    parser.add_argument("--logs", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args()
    # SIGTERM stops the run as Ctrl-C does: asyncio.run's own SIGINT handler cancels the
    # run, so the fleet's processes are stopped before it exits (KeyboardInterrupt raised
    # wherever the loop happened to be could skip that).
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    with tempfile.TemporaryDirectory() as temporary:
        logs = args.logs or Path(temporary)
        logs.mkdir(parents=True, exist_ok=True)
        report = asyncio.run(main(args.seed, args.duration_s, args.redis, args.clients, logs))
    print(table(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[chaos] wrote {args.out}")
    sys.exit(1 if report["anomalies"] else 0)
