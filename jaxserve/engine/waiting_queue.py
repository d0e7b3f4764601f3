"""The waiting queue: sequences not yet running, grouped by request, admitted round-robin.

A request with many samples (``n``, ``best_of``, or many prompts each with ``n``) must not
hold back the requests that arrive after it: admission takes one sequence from each waiting
group per round (``round_robin``), in group order: arrival, or ``(priority, arrival)`` under
the priority policy. A group is one engine request, or the prompts of one API call
(``Request.group_id``). A preempted sequence goes back to the front (``push_front``), so it
resumes before anything new starts.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from jaxserve.engine.request import Sequence


class WaitingQueue:
    def __init__(self, by_priority: bool = False) -> None:
        self.by_priority = by_priority
        # group id -> its waiting sequences in order; the dict's order is the admission order.
        self._queues: dict[str, collections.deque[Sequence]] = {}
        self._num_admitted: dict[str, int] = {}  # taken by the current round_robin pass
        self._len = 0

    @staticmethod
    def priority_key(seq: Sequence) -> tuple[int, float]:
        return (seq.request.priority, seq.request.arrival_time)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self._queues.values():
            yield from queue

    def push(self, seq: Sequence) -> None:
        """Behind the request's other waiting sequences."""
        group_id = seq.request.group_id
        queue = self._queues.get(group_id)
        if queue is None:
            queue = self._queues[group_id] = collections.deque([seq])
            if self.by_priority:
                self._sort()
        else:
            queue.append(seq)
        self._len += 1

    def push_front(self, seq: Sequence) -> None:
        """First of all: a preempted sequence, or samples whose sibling has prefilled."""
        group_id = seq.request.group_id
        queue = self._queues.pop(group_id, collections.deque())
        queue.appendleft(seq)
        self._queues = {group_id: queue, **self._queues}
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence if it is waiting (a no-op otherwise)."""
        queue = self._queues.get(seq.request.group_id)
        if queue is None or seq not in queue:
            return
        queue.remove(seq)
        self._len -= 1
        if not queue:
            del self._queues[seq.request.group_id]

    def _sort(self) -> None:
        ordered = sorted(self._queues.items(), key=lambda item: self.priority_key(item[1][0]))
        self._queues = dict(ordered)

    # -- admission -------------------------------------------------------------------------

    def round_robin(self) -> Iterator[Sequence]:
        """Candidates in admission order: the first waiting sequence of each request, then
        the second of each, ... The caller marks the ones it admits (``mark_admitted``) and
        stops at the first that does not fit, so the admitted ones are a prefix of each
        request's queue; ``remove_admitted`` then takes them out."""
        queues = list(self._queues.values())
        depth = 0
        while queues:
            queues = [q for q in queues if len(q) > depth]
            for queue in queues:
                yield queue[depth]
            depth += 1

    def mark_admitted(self, seq: Sequence) -> None:
        group_id = seq.request.group_id
        self._num_admitted[group_id] = self._num_admitted.get(group_id, 0) + 1

    def remove_admitted(self) -> None:
        for group_id, count in self._num_admitted.items():
            queue = self._queues[group_id]
            for _ in range(count):
                queue.popleft()
            self._len -= count
            if not queue:
                del self._queues[group_id]
        self._num_admitted.clear()
