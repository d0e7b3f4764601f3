"""The KV-event publisher: vLLM's ``ZmqEventPublisher``, on its own thread.

``EngineCore`` hands it each step's events (``publish``, from the engine thread, never
blocking: past ``max_queue_size`` waiting batches a batch is dropped and counted). The thread
encodes a batch (``kv_events.encode_batch``) and sends it on a ZeroMQ PUB socket as three
frames: the topic, the batch's sequence number (8 bytes, big-endian, from 0) and the msgpack
payload. The last ``buffer_steps`` batches are kept; a ROUTER socket on ``replay_endpoint``
answers a request ``[identity, b"", start]`` (start: 8 bytes, big-endian) with every kept batch
from ``start`` on, each ``[identity, b"", seq, payload]``, then ``[identity, b"", -1, b""]``
(seq -1: the end). Subscribers: llm-d's KV-cache indexer, docs/kv_events.md's example.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading

import zmq

from jaxserve.engine.kv_events import KVCacheEvent, encode_batch
from jaxserve.engine_config import KVEventsConfig

_LOG = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule for data parallel ranks: rank r publishes on the endpoint's port + r (an
    inproc endpoint gets a ``_dp{r}`` suffix)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"kv_events_config endpoint={endpoint!r} must be tcp:// or inproc://")


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's heuristic: a wildcard address (or ipc / inproc) is bound, any other connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0  # batches dropped because the queue was full
        self.num_published = 0
        self._queue: queue.Queue[list[KVCacheEvent] | None] = queue.Queue(config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self._topic = config.topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        assert endpoint is not None
        if is_bind_endpoint(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        replay = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        if replay is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="jaxserve-kv-events", daemon=True)
        self._thread.start()
        _LOG.info("Publishing KV-cache events on %s (replay: %s)", self.endpoint, replay)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (engine thread; never waits)."""
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                _LOG.warning(
                    "KV-event queue full (max_queue_size=%d): %d batches dropped",
                    self.config.max_queue_size,
                    self.num_dropped,
                )

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            try:
                payload = encode_batch(events, self.config.event_encoding, self.data_parallel_rank)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # a failed batch must not stop the stream
                _LOG.exception("KV-event batch %d could not be published", seq)
                continue
            self._buffer.append((seq, payload))
            self.num_published += 1
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            _LOG.warning("KV-event replay request of %d frames ignored (3 expected)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(
    config: KVEventsConfig | None, data_parallel_rank: int = 0
) -> ZmqEventPublisher | None:
    """The publisher ``config`` asks for; None when events are off or go to "null"."""
    if config is None or not config.is_publishing:
        return None
    return ZmqEventPublisher(config, data_parallel_rank)
