"""``python -m bench.chaos.vllm`` (``make soak-vllm``): the real engine under faults.

One vLLM worker (SmolLM2 on the CPU; two engines never run at once on this machine), two
gateways and a Redis with AOF behind the run's fault proxy (bench/chaos/network.py).
Session readers keep it busy, greedy (temperature 0), dropping their stream at times and
resuming with ``Last-Event-ID`` on either gateway, while a fault strikes every few
seconds, mid-reply:

- the worker SIGSTOPped 1 to 8 s (past the 5 s worker timeout the reaper takes its replies
  over, and the same worker, awake again, continues them);
- its links to Redis cut (blackhole, one way, latency, reset: a reset closes its lease, so
  its replies are taken over at once, and its old runs are refused);
- the worker SIGKILLed or SIGTERMed (it drains its replies), a new one started once it is
  gone (the replies wait in the queue meanwhile);
- a gateway SIGKILLed (its readers resume on the other) and started again.

First, with no fault, each prompt is answered once: its token ids are the reference. Every
reply must then be, token id for token id, the reference's first ``max_tokens`` ids (a
taken-over reply goes on from the prompt plus the ids streamed, so greedy decoding gives
the same ids), numbered 1, 2, 3... with one final ``done``. Writes the report (faults by
kind, replies, takeovers, anomalies) to ``--out``; exits 1 on an anomaly.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import fcntl
import json
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos.check import session_events
from bench.chaos.clients import Context, Record, create_session, follow_session, send_message
from bench.chaos.fleet import Fault, signal_all
from bench.chaos.network import HOWS, Cut
from bench.chaos.redises import Datastore, datastore
from bench.chaos.tenants import ApiKey
from gateway.core.settings import Settings
from stack import processes, procfs
from stack.redis_server import free_port
from stack.rig import HOST, VLLM_LOCK, Gateway, Rig

MODEL = "smol"
PROMPTS = [
    "Write a poem of eight lines about a lighthouse keeper and the sea.",
    "Explain in a few sentences why the sky is blue.",
    "List five uses of copper, one per line.",
    "Tell a short story about a fox who learns to read.",
    "Describe a quiet morning in a mountain village.",
    "What makes a good cup of tea? Answer in three steps.",
]
LONGEST = 48
LENGTHS = (16, 32, LONGEST)
FAULTS = {
    "worker_stop": 3.0,
    **{f"worker_{how}": 1.5 for how in HOWS},
    "gateway_kill": 1.0,
    "worker_kill": 0.6,
    "worker_term": 0.6,
}
"""Each fault kind's weight: a kill or a SIGTERM costs a new worker (some 40 s here)."""
GAP_S = (2.5, 5.0)
BOUND_S = 300.0
"""A reply ends within this, new workers' starts included (else it hung)."""
MAX_TAKEOVERS = Settings().max_takeovers
"""How often the gateways take one reply over (``TOKENSPOUT_MAX_TAKEOVERS``, the run leaves
it at its default); past it, the reply ends ``worker_lost`` (docs/reliability.md)."""
ANYONE = ApiKey("anyone", "", "", 1.0)
"""The gateways take no key: the run's requests carry none."""


@dataclass
class VllmFleet:
    rig: Rig
    store: Datastore
    ports: list[int]
    gateways: dict[int, Gateway] = field(default_factory=dict)
    worker: Any = None
    faults: list[Fault] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    worker_ready: asyncio.Event = field(default_factory=asyncio.Event)

    def now(self) -> float:
        return time.monotonic() - self.started

    @property
    def urls(self) -> list[str]:
        return [f"http://{HOST}:{port}" for port in self.ports]

    def note(self, kind: str, held_s: float = 0.0, note: str = "") -> None:
        self.faults.append(Fault(round(self.now(), 2), kind, "", round(held_s, 2), note))
        print(f"[soak-vllm] {self.now():6.1f} s {kind} {note}".rstrip(), flush=True)

    def start_worker(self) -> None:
        self.worker = self.rig.engine(
            *("--backend", "vllm", "--model", "default", "--served-model-name", MODEL),
            *("--capacity", "8", "--drain-s", "120", "--metrics-port", str(free_port())),
        )

    async def replace_worker(self, how: str) -> None:
        """SIGKILL or SIGTERM the worker; once it is gone, start another."""
        self.worker_ready.clear()
        old = self.worker
        if how == "kill":
            processes.kill(old)
        else:
            old.send_signal(signal.SIGTERM)
            await asyncio.to_thread(old.wait, 180)
        await asyncio.to_thread(self.start_worker)
        self.worker_ready.set()

    async def strike(self, kind: str, rng: random.Random) -> None:
        if kind == "gateway_kill":
            port = rng.choice(self.ports)
            self.note(kind, note=f"gateway:{port}")
            processes.kill(self.gateways[port].process)
            self.gateways[port] = await asyncio.to_thread(self.rig.gateway, port)
            return
        if not self.worker_ready.is_set():
            return  # its worker is being replaced: no fault on it meanwhile
        how = kind.removeprefix("worker_")
        if how in ("kill", "term"):
            self.note(kind)
            await self.replace_worker(how)
        elif how == "stop":
            held_s = rng.uniform(1.0, 8.0)
            self.note(kind, held_s)
            pids = procfs.tree(self.worker.pid)
            signal_all(pids, signal.SIGSTOP)
            try:
                await asyncio.sleep(held_s)
            finally:
                signal_all(pids, signal.SIGCONT)
        else:
            cut = Cut.draw(how, rng)
            self.note(kind, cut.held_s, cut.describe())
            await self.store.proxy.cut(cut, pids=[self.worker.pid])


@contextlib.contextmanager
def vllm_fleet(logs: Path) -> Iterator[VllmFleet]:
    store = datastore("single", logs)
    rig = Rig(store.url, f"vchaos-{random.randrange(1 << 24):06x}", logs, {})
    fleet = VllmFleet(rig, store, [free_port(), free_port()])
    try:
        fleet.start_worker()
        for port in fleet.ports:
            fleet.gateways[port] = rig.gateway(port)
        fleet.worker_ready.set()
        yield fleet
    finally:
        rig.stop()
        store.cleanup()


class VllmRun:
    def __init__(self, seed: int, duration_s: float, fleet: VllmFleet, loops: int) -> None:
        self.seed, self.duration_s, self.fleet, self.loops = seed, duration_s, fleet, loops
        self.ctx = Context(fleet.urls, fleet.now)
        self.reference: dict[str, list[int]] = {}
        self.records: list[Record] = []
        self.anomalies: list[dict[str, Any]] = []

    def anomaly(self, at_s: float, label: str, what: str) -> None:
        self.anomalies.append(
            {"seed": self.seed, "at_s": round(at_s, 1), "client": label, "what": what}
        )
        print(f"[soak-vllm] ANOMALY at {at_s:.1f} s {label}: {what}", flush=True)

    async def read(
        self, rng: random.Random, label: str, prompt: str, max_tokens: int, drop_every: int | None
    ) -> Record:
        record = Record(
            "sse",
            label,
            MODEL,
            prompt,
            max_tokens,
            self.ctx.clock(),
            ANYONE,
            params={"temperature": 0},
        )
        record.session = await create_session(self.ctx, rng, record)
        record.generation_id = await send_message(self.ctx, rng, record, record.session)
        await follow_session(self.ctx, rng, record, None, drop_every=drop_every, slow=False)
        return record

    async def measure_reference(self) -> None:
        """Each prompt answered once, uninterrupted: its token ids."""
        rng = random.Random(self.seed)
        for index, prompt in enumerate(PROMPTS):
            record = await self.read(rng, f"reference{index}", prompt, LONGEST, None)
            if record.final != "done":
                raise RuntimeError(f"the reference of {prompt!r} ended {record.final}")
            self.reference[prompt] = token_ids(record)
        print(f"[soak-vllm] references measured at {self.fleet.now():.0f} s", flush=True)

    async def client_loop(self, index: int) -> None:
        rng = random.Random(f"vllm-client-{self.seed}-{index}")
        count = 0
        while self.fleet.now() < self.duration_s:
            label = f"c{index}.{count}"
            prompt, length = rng.choice(PROMPTS), rng.choice(LENGTHS)
            started = self.fleet.now()
            try:
                async with asyncio.timeout(BOUND_S):
                    record = await self.read(rng, label, prompt, length, rng.choice([None, 6]))
            except TimeoutError:
                self.anomaly(started, label, f"no end within {BOUND_S:.0f} s (hung)")
            except Exception as exc:
                self.anomaly(started, label, f"client failed: {exc!r}")
            else:
                self.records.append(record)
                for problem in self.check(record, self.struck(started, self.fleet.now())):
                    self.anomaly(started, label, problem)
            count += 1

    def struck(self, from_s: float, to_s: float) -> int:
        """The faults between ``from_s`` and ``to_s`` that lose the worker to the gateways:
        a kill, a SIGTERM (its drain hands its replies over), a reset (its lease closes), a
        stop or a cut of its links as long as the worker timeout (added latency: never)."""
        timeout_s = Settings().worker_timeout_s
        return sum(
            from_s <= fault.at_s <= to_s
            and (
                fault.kind in ("worker_kill", "worker_term", "worker_reset")
                or (fault.kind.startswith("worker_") and fault.held_s >= timeout_s)
            )
            and fault.kind != "worker_latency"
            for fault in self.fleet.faults
        )

    def check(self, record: Record, struck: int) -> list[str]:
        """``struck``: the faults that struck its worker while it ran. A reply the gateways
        took over ``MAX_TAKEOVERS`` times ends ``worker_lost`` at the next loss of its
        worker, as documented: allowed where more faults than that struck its worker (the
        one worker here), and its ids up to there must be the uninterrupted reply's."""
        found = list(record.problems) + session_events([record])
        expected = self.reference[record.content][: record.max_tokens]
        code = record.final_data.get("code")
        if record.final == "error" and code == "worker_lost" and struck > MAX_TAKEOVERS:
            expected = expected[: len(token_ids(record))]
        elif record.final != "done":
            found.append(f"ended {record.final}: {json.dumps(record.final_data)[:200]}")
        got = token_ids(record)
        if got != expected:
            took = sum(
                e == "resumed"
                for _, e, d in record.events
                if d.get("generation_id") == record.generation_id
            )
            first = next(
                (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                min(len(got), len(expected)),
            )
            found.append(
                f"token ids differ from the uninterrupted reply at {first} "
                f"({len(got)} vs {len(expected)} ids, {took} takeovers)"
            )
        return found

    async def inject(self) -> None:
        rng = random.Random(f"vllm-faults-{self.seed}")
        kinds, weights = list(FAULTS), list(FAULTS.values())
        tasks = []
        while self.fleet.now() < self.duration_s - 5:
            await asyncio.sleep(rng.uniform(*GAP_S))
            kind = rng.choices(kinds, weights)[0]
            tasks.append(asyncio.create_task(self.fleet.strike(kind, rng)))
            tasks = [t for t in tasks if not t.done()]
        await asyncio.gather(*tasks)

    async def run(self) -> None:
        try:
            await self.measure_reference()
            self.fleet.started = time.monotonic()
            injector = asyncio.create_task(self.inject())
            await asyncio.gather(*(self.client_loop(i) for i in range(self.loops)))
            await injector
        finally:
            await self.ctx.close()
            await self.fleet.store.proxy.control.close()

    def report(self) -> dict[str, Any]:
        takeovers = sum(e == "resumed" for r in self.records for _, e, _ in r.events)
        return {
            "seed": self.seed,
            "duration_s": self.duration_s,
            "client_loops": self.loops,
            "faults": len(self.fleet.faults),
            "faults_by_kind": dict(
                sorted(collections.Counter(f.kind for f in self.fleet.faults).items())
            ),
            "replies": len(self.records),
            "tokens_checked": sum(len(token_ids(r)) for r in self.records),
            "takeovers_seen": takeovers,
            "reconnects": sum(r.reconnects for r in self.records),
            "anomalies": self.anomalies,
            "fault_log": [vars(f) for f in self.fleet.faults],
        }


def token_ids(record: Record) -> list[int]:
    """The token ids of the record's generation, in the order read."""
    return [
        token
        for _, event, data in record.events
        if event == "token" and data.get("generation_id") == record.generation_id
        for token in data.get("token_ids") or []
    ]


async def main(seed: int, duration_s: float, loops: int, logs: Path) -> dict[str, Any]:
    print(
        f"[soak-vllm] seed {seed}, {duration_s:.0f} s, {loops} readers; logs in {logs}", flush=True
    )
    with vllm_fleet(logs) as fleet:
        print("[soak-vllm] fleet up: 1 vLLM worker, 2 gateways", flush=True)
        run = VllmRun(seed, duration_s, fleet, loops)
        await run.run()
        return run.report()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos.vllm", description=__doc__)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=300, help="of faults")
    parser.add_argument("--clients", type=int, default=6, help="reader loops at once")
    parser.add_argument("--out", type=Path, help="write the report (JSON) here")
    parser.add_argument("--logs", type=Path, help="keep the processes' logs here")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    with tempfile.TemporaryDirectory() as temporary, VLLM_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two vLLM engines never run at once here
        logs = args.logs or Path(temporary)
        logs.mkdir(parents=True, exist_ok=True)
        report = asyncio.run(main(args.seed, args.duration_s, args.clients, logs))
    print(json.dumps({k: v for k, v in report.items() if k != "fault_log"}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    sys.exit(1 if report["anomalies"] else 0)
