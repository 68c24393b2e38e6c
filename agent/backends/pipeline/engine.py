"""The first stage's scheduler: the torch_worker HTTP layer submits jobs here, as it would to the
batched engine; this thread decides the batches, runs the first layers, sends each step down the
pipeline and hands the tokens coming back from the last stage to their readers.

Decoding rows are split into up to `lanes` micro-batches, each a batch of its own on every stage:
while the later stages work on one lane's step, this stage runs the next lane's, so the stages work
at the same time. Row operations (rows joining, leaving, set aside) travel in the header of the next
step and are applied by every stage in the same order; a batch is only changed while none of its
steps is in flight. A newcomer is prefilled as a batch of its own, then joins a lane."""

from __future__ import annotations

import json
import secrets
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from agent.backends.outbox import Arrivals
from agent.backends.pipeline.link import Link, LinkError
from agent.backends.pipeline.rows import Ledger
from agent.backends.torch.engine import Job

STAGE_FAILED = "pipeline_stage_failed"  # the code a client gets when a stage ends its request
PREFILL_TOKENS = 4096  # prompt tokens prefilled in one step at most (a longer prompt still goes alone)
TICK_S = 2.0  # an idle pipeline sends an empty step this often: every stage's receive stays bounded


@dataclass(frozen=True, slots=True)
class Flight:
    """A step sent down the pipeline whose tokens have not come back yet."""

    seq: int
    kind: str  # "p" prefill, "d" decode, "t" nothing to run (row operations, or a liveness tick)
    batch: int | None
    jobs: tuple[Job, ...]


class PipelineEngine:
    """Stage 0's decode loop, on its own thread (`run`). `submit`, `kick`, `stats` and `fail` are
    called from other threads."""

    def __init__(self, ledger: Ledger, link: Link, eos: set[int], max_batch: int = 16, lanes: int = 2,
                 tick_s: float = TICK_S, threads: int | None = None) -> None:
        self.ledger, self.link, self.eos = ledger, link, frozenset(eos)
        self.max_batch, self.lane_count, self.tick_s, self.threads = max_batch, max(1, lanes), tick_s, threads
        self.prefill_tokens = PREFILL_TOKENS
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._live: set[Job] = set()  # every job not yet ended and forgotten: what a failure must end
        self._arrivals: Arrivals[Job] = Arrivals()
        self._waiting: deque[Job] = deque()
        self._batches: dict[int, list[Job]] = {}  # as the ledger's members, by job
        self._rid: dict[Job, int] = {}
        self._lanes: list[int] = []  # batches decoding
        self._loose: list[int] = []  # prefilled, not yet in a lane
        self._aside: list[int] = []  # one row each, whose reader is behind
        self._flight: deque[Flight] = deque()
        self._flying: set[int] = set()
        self._ops: list[list[Any]] = []
        self._seq = self._next_batch = self._next_rid = 0
        self.steps = self.widest = self.set_aside = 0

    # Other threads.

    def coming(self, n: int) -> None:
        """A request on its way: nothing here (the first stage prefills newcomers as they come)."""

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.failed is not None:
                job.end("error", error=self.failed, code=STAGE_FAILED)
                return
            self._live.add(job)
        self._arrivals.put(job)

    def kick(self) -> None:
        self._arrivals.kick()

    def stats(self) -> dict[str, int]:
        # list() copies in one step under the GIL: the engine thread may be changing the batches.
        return {"steps": self.steps, "widest_step": self.widest, "set_aside": self.set_aside,
                "rows": sum(map(len, list(self._batches.values()))), "lanes": len(self._lanes),
                "waiting": len(self._waiting) + self._arrivals.pending(), "in_flight": len(self._flight),
                "compute_us": self.ledger.busy_ns // 1000,
                **self.link.stats()}

    def fail(self, reason: str) -> None:
        """End every request with `reason`; later ones are refused with it."""
        with self._lock:
            self.failed = reason
            jobs, self._live = list(self._live), set()
        for job in jobs:
            if not job.ended:
                job.end("error", error=reason, code=STAGE_FAILED)
        self._arrivals.kick()

    # The stage's thread.

    def warm_up(self) -> None:
        """One empty step around the pipeline: every stage has formed and answers."""
        self._send(None, "t", (), None, None)
        self._receive()

    def run(self) -> None:
        """Until the pipeline fails; LinkError when a peer does (the caller turns it into the reason)."""
        if self.threads:  # the intra-op thread count is per thread with some OpenMP builds
            torch.set_num_threads(self.threads)
        while self.failed is None:
            self._arrivals.kicked.clear()  # before looking, so that a kick after the look is not lost
            with torch.inference_mode():
                worked = self._once()
            if not worked and not self._arrivals.kicked.wait(self.tick_s) and self.failed is None:
                self._send(None, "t", (), None, None)
                self._receive()

    def _once(self) -> bool:
        self._arrivals.take(self._waiting)
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            job.end("stop")
            self._forget(job)
        for b in [b for b in self._batches if b not in self._flying]:
            self._tidy(b)
        self._admit()
        self._arrange()
        for b in [b for b in self._lanes if b not in self._flying]:
            jobs = tuple(self._batches[b])
            hidden = self.ledger.decode(b, self.ledger.embed_tokens([j.next_token for j in jobs]))
            self._send(b, "d", jobs, {"k": "d", "b": b}, hidden)
        if self._ops:  # operations with no step to carry them (rows that left an idle pipeline)
            self._send(None, "t", (), None, None)
        if not self._flight:
            return False
        self._receive()
        return True

    def _tidy(self, b: int) -> None:
        """Rows that ended or whose client left go; a row whose reader is full goes aside; a row set
        aside whose reader has room again is loose, to join a lane."""
        jobs, keep = self._batches[b], []
        for job in jobs:
            if job.cancelled and not job.ended:
                job.end("stop")
            if job.ended:
                self._forget(job)
            elif b not in self._aside and job.outbox.waiting() >= job.outbox.capacity:
                nb = self._batch()
                self._op(["carve", b, nb, [self._rid[job]]])
                self._batches[nb] = [job]
                self._aside.append(nb)
                self.set_aside += 1
            else:
                keep.append(job)
        if len(keep) != len(jobs):
            self._op(["keep", b, [self._rid[j] for j in keep]])
            self._batches[b] = keep
            if not keep:
                self._drop(b)
        elif b in self._aside and keep[0].outbox.waiting() <= keep[0].outbox.capacity // 2:
            self._aside.remove(b)
            self._loose.append(b)

    def _admit(self) -> None:
        """Prefill, together, the newcomers that fit; one prefill in flight at a time."""
        if not self._waiting or any(f.kind == "p" for f in self._flight):
            return
        room = self.max_batch - sum(len(j) for j in self._batches.values())
        jobs: list[Job] = []
        tokens = 0
        while self._waiting and len(jobs) < room and (
                not jobs or tokens + len(self._waiting[0].prompt) <= self.prefill_tokens):
            job = self._waiting.popleft()
            tokens += len(job.prompt)
            jobs.append(job)
        if not jobs:
            return
        b, rows = self._batch(), []
        for job in jobs:
            self._rid[job] = self._next_rid
            rows.append(self._next_rid)
            self._next_rid += 1
        sampling = [[j.params.temperature, j.params.top_p,
                     j.params.seed if j.params.seed is not None else secrets.randbits(63)] for j in jobs]
        lengths = [len(j.prompt) for j in jobs]
        hidden = self.ledger.prefill(b, rows, lengths, self.ledger.embed_prompts([j.prompt for j in jobs]))
        self._batches[b] = jobs
        self._send(b, "p", tuple(jobs), {"k": "p", "b": b, "rows": rows, "len": lengths, "s": sampling}, hidden)

    def _arrange(self) -> None:
        """Loose batches become lanes while there are fewer than wanted, else join the lane with
        fewest rows; then, while lanes are missing, an idle lane of two rows or more is halved."""
        for b in list(self._loose):
            if len(self._lanes) < self.lane_count:
                self._loose.remove(b)
                self._lanes.append(b)
                continue
            # The lane with fewest rows takes it (an idle one on a tie); one in flight is waited for,
            # a step at most, so that the lanes stay even and so do the stages' steps.
            target = min(self._lanes, key=lambda lane: (len(self._batches[lane]), lane in self._flying))
            if target in self._flying:
                continue
            self._op(["join", target, [target, b]])
            self._batches[target] = self._batches[target] + self._batches.pop(b)
            self._loose.remove(b)
        while len(self._lanes) < self.lane_count:
            idle = [lane for lane in self._lanes if lane not in self._flying and len(self._batches[lane]) >= 2]
            if not idle:
                break
            src = max(idle, key=lambda lane: len(self._batches[lane]))
            jobs = self._batches[src]
            half, nb = len(jobs) // 2, self._batch()
            self._op(["carve", src, nb, [self._rid[j] for j in jobs[half:]]])
            self._op(["keep", src, [self._rid[j] for j in jobs[:half]]])
            self._batches[src], self._batches[nb] = jobs[:half], jobs[half:]
            self._lanes.append(nb)

    def _op(self, op: list[Any]) -> None:
        self.ledger.apply([op])  # here now; on the other stages before the next step's run
        self._ops.append(op)

    def _send(self, b: int | None, kind: str, jobs: tuple[Job, ...], run: dict[str, Any] | None,
              hidden: torch.Tensor | None) -> None:
        header: dict[str, Any] = {"ops": self._ops}
        if run is not None:
            header["run"] = run
        self._ops = []
        seq, self._seq = self._seq, self._seq + 1
        self.link.send_step(seq, json.dumps(header, separators=(",", ":")).encode(), hidden)
        self._flight.append(Flight(seq, kind, b, jobs))
        if b is not None:
            self._flying.add(b)

    def _receive(self) -> None:
        flight = self._flight.popleft()
        seq, tokens = self.link.recv_tokens(len(flight.jobs))
        if seq != flight.seq:
            raise LinkError(self.link.prev, f"answered step {seq} where step {flight.seq} was due")
        if flight.batch is not None:
            self._flying.discard(flight.batch)
        if flight.kind == "t":
            return
        if flight.kind == "d":
            self.steps += 1
            self.widest = max(self.widest, len(flight.jobs))
        else:
            assert flight.batch is not None  # a prefill always makes its batch
            self._loose.append(flight.batch)
        for job, token in zip(flight.jobs, tokens):
            if not job.cancelled and not job.ended:
                self._emit(job, token)

    def _emit(self, job: Job, token: int) -> None:
        job.made += 1
        job.next_token = token
        if token in self.eos:
            job.end("stop")
        elif job.made >= job.params.max_new:
            job.end("length", [token])
        else:
            job.outbox.put([token])

    def _batch(self) -> int:
        self._next_batch += 1
        return self._next_batch

    def _drop(self, b: int) -> None:
        del self._batches[b]
        for role in (self._lanes, self._loose, self._aside):
            if b in role:
                role.remove(b)

    def _forget(self, job: Job) -> None:
        self._rid.pop(job, None)
        with self._lock:
            self._live.discard(job)
