"""CompileQueue: grammar compiles on worker threads of their own, shared fairly between clients,
each job ended at its deadline.

``GrammarCompiler`` (grammar.py) submits one job per grammar it has not compiled yet; the
server's routes and the offline ``LLM`` wait on the job's future.

- **Stacks.** llguidance compiles a grammar recursively in Rust, about 3.5 KB of stack per level
  of rule nesting: a thread's default 8 MiB overflows near 2,300 levels (a 50 KB chain of
  rules) and the overflow kills the whole process, with no Python exception to catch. The
  workers get ``COMPILE_STACK_BYTES``: measured, 256 MiB compiles a 56,000-rule chain (a 512 KiB
  grammar) and overflows at 108,000, so the largest source the server accepts
  (``max_grammar_bytes``, 256 KiB by default: 30,000 levels at most) uses under half of it. The
  stack is reserved address space; only the pages a compile reaches are ever touched.
- **Fair share.** Jobs wait in one queue per client (its API key and address); a free worker
  takes a job of the client with the fewest compiles running (of those, the one served least
  recently: clients take turns), and no client runs on more than
  ``NUM_WORKERS - 1`` workers at once: one is always left for the others, so a client sending
  slow grammars delays only its own. Within a client the smallest source goes first, so a
  trivial schema does not wait behind a large grammar sent over the same key.
- **Deadlines.** A job still queued or running at its deadline fails with ``on_timeout()`` and is
  told to stop: a queued job never runs, and a running one's cancel hook (the GBNF conversion's
  process, gbnf.py) is called. llguidance's own compile cannot be interrupted; its limits
  (``LLParserLimits``: fuel, grammar size, lexer states) bound it to well under a second for
  what ``max_grammar_bytes`` admits, and what it returns after the deadline is dropped.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

_LOG = logging.getLogger(__name__)
NUM_WORKERS = 3
MAX_CLIENTS = 10_000  # clients whose turn is remembered
COMPILE_STACK_BYTES = 256 << 20


@dataclasses.dataclass(eq=False)
class Job:
    """One compile: ``run(job)`` on a worker, its result or exception into ``future``."""

    client: str
    cost: int  # the source's size: within a client, the smallest goes first
    run: Callable[[Job], Any]
    deadline: float  # time.monotonic() past which the job fails
    on_timeout: Callable[[], BaseException]
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    is_running: bool = False
    _cancel_hooks: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` if the job is cancelled from now on (at once if it already is)."""
        self._cancel_hooks.append(hook)
        if self.future.done():
            hook()

    @property
    def is_cancelled(self) -> bool:
        return self.future.done()


class CompileQueue:
    def __init__(self, num_workers: int = NUM_WORKERS) -> None:
        self._max_running_per_client = max(1, num_workers - 1)
        self._cond = threading.Condition()
        self._queues: dict[str, list[Job]] = {}
        self._running: collections.Counter[str] = collections.Counter()
        # When each client's last job started (a count), the least recent first to go next;
        # the oldest entries are forgotten past MAX_CLIENTS.
        self._served: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._num_served = 0
        self._jobs: set[Job] = set()  # queued or running: what the deadline watch looks at
        self._closed = False
        self._threads = [
            _start_big_stack_thread(self._work, f"jaxserve-grammar-{i}") for i in range(num_workers)
        ]
        self._threads.append(threading.Thread(target=self._watch_deadlines, daemon=True))
        self._threads[-1].start()

    def submit(
        self,
        client: str,
        cost: int,
        run: Callable[[Job], Any],
        timeout_s: float,
        on_timeout: Callable[[], BaseException],
    ) -> Job:
        job = Job(client, cost, run, time.monotonic() + timeout_s, on_timeout)
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            self._queues.setdefault(client, []).append(job)
            self._jobs.add(job)
            self._cond.notify_all()
        return job

    def extend(self, job: Job, timeout_s: float) -> None:
        """A later caller waits for the same job: it may run until that caller's deadline."""
        with self._cond:
            job.deadline = max(job.deadline, time.monotonic() + timeout_s)

    def num_queued(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            jobs, self._jobs = list(self._jobs), set()
            self._queues.clear()
            self._cond.notify_all()
        for job in jobs:
            _fail(job, RuntimeError("the grammar compiler closed"))

    # -- the threads ------------------------------------------------------------------------

    def _next_job(self) -> Job | None:
        """The smallest queued job of the client with the fewest running, among those under
        their share (under the lock)."""
        waiting = [
            (self._running[c], min(q, key=_order), c)
            for c, q in self._queues.items()
            if q and self._running[c] < self._max_running_per_client
        ]
        if not waiting:
            return None
        _, job, client = min(
            waiting, key=lambda w: (w[0], self._served.get(w[2], -1), _order(w[1]))
        )
        self._num_served += 1
        self._served[client] = self._num_served
        self._served.move_to_end(client)
        if len(self._served) > MAX_CLIENTS:
            self._served.popitem(last=False)
        queue = self._queues[client]
        queue.remove(job)
        if not queue:
            del self._queues[client]
        return job

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._next_job()
                while job is None:
                    if self._closed:
                        return
                    self._cond.wait()
                    job = self._next_job()
                if job.is_cancelled:
                    continue
                job.is_running = True
                self._running[job.client] += 1
            # NOTE: in a function of its own, so no local of this loop keeps the last job (and
            # its compiled grammar) alive while the worker waits for the next.
            self._run(job)
            del job

    def _run(self, job: Job) -> None:
        try:
            result = job.run(job)
        except BaseException as exc:  # noqa: BLE001  delivered to the waiters
            _LOG.debug("A compile job failed", exc_info=True)
            _fail(job, exc)
        else:
            if not job.future.done():
                job.future.set_result(result)
        finally:
            with self._cond:
                self._running[job.client] -= 1
                if not self._running[job.client]:
                    del self._running[job.client]
                self._jobs.discard(job)
                self._cond.notify_all()

    def _watch_deadlines(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                expired = [job for job in self._jobs if job.deadline <= now]
                for job in expired:
                    self._jobs.discard(job)
                    if not job.is_running:
                        self._queues[job.client].remove(job)
                        if not self._queues[job.client]:
                            del self._queues[job.client]
                if not expired:
                    nearest = min((job.deadline for job in self._jobs), default=now + 60)
                    self._cond.wait(max(0.0, nearest - now) + 1e-3)
                    continue
            for job in expired:
                _fail(job, job.on_timeout())


def _order(job: Job) -> tuple[int, float]:
    return job.cost, job.deadline


def _fail(job: Job, exc: BaseException) -> None:
    """The job's waiters get ``exc`` (unless it already ended), then its cancel hooks run.

    ``exc`` loses its traceback and context first: a failed compile's frames hold the matcher
    it built (tens of MB of native memory for ``a{1000000}``), and a refusal is kept in the
    cache for as long as the grammar would be."""
    exc.__traceback__ = exc.__context__ = exc.__cause__ = None
    try:
        job.future.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        return
    for hook in job._cancel_hooks:
        hook()


def _start_big_stack_thread(target: Callable[[], None], name: str) -> threading.Thread:
    # NOTE: threading.stack_size applies to every thread started until it is put back; a thread
    # another module starts in that instant gets a large reserved stack too, which costs it
    # address space only.
    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    finally:
        threading.stack_size(previous)
    return thread
