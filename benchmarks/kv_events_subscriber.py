"""A KV-event subscriber that drains a server's stream, as a router would, for the kv_events
stage of run_h200.sh: it connects a SUB socket to ``--endpoint``, decodes every batch (msgpack,
vLLM's ``KVEventBatch``), counts batches, events by type and sequence gaps, and on SIGTERM or
after ``--seconds`` writes the counts as JSON to ``--out`` (and prints them).

    python -m benchmarks.kv_events_subscriber --endpoint tcp://localhost:5557 --out sub.json
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import time

import msgpack
import zmq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", default="tcp://localhost:5557")
    parser.add_argument("--topic", default="", help="the subscription prefix")
    parser.add_argument("--seconds", type=float, default=None, help="stop after; default: SIGTERM")
    parser.add_argument("--out", default=None, help="JSON file for the counts")
    args = parser.parse_args()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(args.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    counts: collections.Counter[str] = collections.Counter()
    num_batches = num_gaps = num_bytes = 0
    last_seq = None
    start = time.time()
    while not stopping and (args.seconds is None or time.time() - start < args.seconds):
        if not sub.poll(200):
            continue
        _, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        num_gaps += last_seq is not None and seq != last_seq + 1
        last_seq = seq
        num_batches += 1
        num_bytes += len(payload)
        for event in msgpack.unpackb(payload, raw=False)[1]:
            counts[event["type"] if isinstance(event, dict) else event[0]] += 1
    sub.close(linger=0)
    result = {
        "batches": num_batches,
        "events": dict(counts),
        "sequence_gaps": num_gaps,
        "payload_bytes": num_bytes,
        "seconds": round(time.time() - start, 1),
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
