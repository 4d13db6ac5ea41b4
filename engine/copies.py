"""A request queued twice, its second copy taken while the first one's claim is on its way.

The gateway's stateless submit sends the session's SUBMIT script and the queue's XADD in
one pipeline. When Redis has lost its scripts (a restart), the script fails with NOSCRIPT
but the XADD goes in: that first copy names a generation that does not exist yet, and its
claim is refused. The gateway loads the script and sends both again, so a second copy
follows. A worker that took the second copy while the first one's claim was still on its
way used to drop it as a duplicate; the first was then refused, and the generation never
ran (its stream waited forever). The second copy is now held until the claim is answered:
dropped if the claim holds, run if it was refused.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.job import Job
    from engine.worker import Worker

log = logging.getLogger("tokenspout.worker")


def settle_second_copy(worker: Worker, job: Job, claimed: bool) -> None:
    """``job``'s claim is answered (``claimed``: it holds, or the first copy ended the
    generation otherwise): drop the copy held meanwhile, or run it in ``job``'s place."""
    second, job.second_copy = job.second_copy, None
    if second is None:
        return
    if claimed:
        log.info("dropping a second copy of %s", job.generation_id)
        task = asyncio.create_task(worker._ack_or_retry_later(second.entry_id))
    else:
        log.info("the first copy of %s was refused: running the second", job.generation_id)
        worker.jobs[job.generation_id] = second
        task = asyncio.create_task(worker._run_job(second), name=job.generation_id)
    worker._tasks.add(task)
    task.add_done_callback(worker._tasks.discard)
