"""KV-cache events (``--kv-events-config``): what the block pool publishes over ZeroMQ, decoded
with the schema vLLM's subscribers use (vLLM's ``KVEventBatch``: an array ``[ts, events,
data_parallel_rank]``, each event a map tagged by ``type``, or the earlier tagged array), the
hash chain a router recomputes, eviction, reset, replay of a gap, and the config's checks.

The engine runs on the scheduler tests' fake runner (hand-computable tokens: each token is the
previous one + 1) over the llama fixture's config, blocks of 4 tokens; one test runs the real
fixture model behind the HTTP server."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from jaxserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
    external_block_hash,
    root_block_hash,
)
from jaxserve.engine_config import KVEventsConfig
from jaxserve.sampling_params import SamplingParams
from tests.conftest import tiny_server
from tests.test_scheduler import make_core, run_all

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# vLLM's event fields, in declaration order, as its subscribers read them (the fields with a
# default may be absent from a map).
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
)


def events_config(**changes: Any) -> KVEventsConfig:
    fields = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:*",  # a wildcard port: bound, to a free one
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv-events",
        **changes,
    }
    return KVEventsConfig(**fields)


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A subscriber's decoding: the batch array, each event map or tagged array to a dict."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and 2 <= len(batch) <= 3
    ts, raw_events = batch[0], batch[1]
    events = []
    for raw in raw_events:
        if isinstance(raw, dict):
            events.append(raw)
            continue
        tag, *values = raw  # the array layout: the tag, then the fields by position
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": ("block_hashes", "medium")}
        events.append({"type": tag, **dict(zip(names.get(tag, ()), values, strict=False))})
    return ts, events, batch[2] if len(batch) > 2 else None


class Subscriber:
    """A SUB socket on the publisher's endpoint, and a DEALER on its replay endpoint."""

    def __init__(self, publisher) -> None:
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(publisher.endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        self.replay_endpoint = publisher.replay_endpoint
        time.sleep(0.3)  # PUB/SUB: a subscription made before the first send is honoured

    def receive(self, timeout_ms: int = 5000) -> list[tuple[int, list[dict[str, Any]]]]:
        """Every batch until none arrives for ``timeout_ms`` (at least one)."""
        batches = []
        while self.sub.poll(timeout_ms if not batches else 300):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"kv-events" and len(seq) == 8
            ts, events, rank = decode_batch(payload)
            assert rank == 0 and abs(ts - time.time()) < 60
            batches.append((int.from_bytes(seq, "big"), events))
        assert batches, "no KV-event batch arrived"
        return batches

    def replay(self, start: int) -> list[tuple[int, list[dict[str, Any]]]]:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        batches = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                break
            batches.append((int.from_bytes(seq, "big"), decode_batch(payload)[1]))
        dealer.close(linger=0)
        return batches

    def close(self) -> None:
        self.sub.close(linger=0)


def events_of(batches, kind: str) -> list[dict[str, Any]]:
    return [e for _, events in batches for e in events if e["type"] == kind]


def expected_chain(tokens: list[int], block_size: int = 4) -> list[int]:
    parent, out = root_block_hash(), []
    for i in range(len(tokens) // block_size):
        parent = external_block_hash(parent, tokens[i * block_size : (i + 1) * block_size], None)
        out.append(parent)
    return out


def test_block_hash_is_sha256_of_canonical_cbor() -> None:
    """The published hash, from the bytes llm-d hashes: CBOR [parent, tokens, null]."""
    parent = 2**64 - 3
    cbor = b"\x83\x1b" + parent.to_bytes(8, "big") + b"\x84\x01\x18\x64\x19\x01\x2c\x00\xf6"
    digest = hashlib.sha256(cbor).digest()
    assert external_block_hash(parent, [1, 100, 300, 0], None) == int.from_bytes(digest[24:])
    assert root_block_hash("") == int.from_bytes(hashlib.sha256(b"\x60").digest()[24:])
    assert root_block_hash("42") == int.from_bytes(hashlib.sha256(b"\x6242").digest()[24:])


def test_batch_encodings_are_vllms() -> None:
    events = [BlockStored([7, 2**64 - 1], 5, [1, 2], 1, [None, None]), BlockRemoved([7])]
    events.append(AllBlocksCleared())
    batch = msgpack.unpackb(encode_batch(events, "map", ts=1.5), raw=False)
    assert batch[0] == 1.5 and batch[2] == 0
    stored, removed, cleared = batch[1]
    assert list(stored)[:9] == ["type", *STORED_FIELDS, "lora_name", "extra_keys"]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [7, 2**64 - 1]
    assert stored["kv_cache_spec_kind"] == "full_attention" and stored["group_idx"] == 0
    assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}
    array = msgpack.unpackb(encode_batch(events, "array", ts=1.5), raw=False)
    assert array[1] == [
        ["BlockStored", [7, 2**64 - 1], 5, [1, 2], 1, None, "GPU"],
        ["BlockRemoved", [7], "GPU"],
        ["AllBlocksCleared"],
    ]
    # msgpack of a float is a float64, as msgspec writes it
    assert encode_batch([], ts=1.5)[:10] == b"\x93\xcb" + (b"?\xf8" + b"\x00" * 6)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_stored_events_carry_the_prompt_and_its_hash_chain(encoding) -> None:
    core, _ = make_core(kv_events_config=events_config(event_encoding=encoding))
    sub = Subscriber(core.kv_event_publisher)
    try:
        prompt = list(range(10, 20))  # 10 tokens: two full blocks of 4, then 2 + generated
        core.add_request("a", prompt, GREEDY)
        run_all(core)
        batches = sub.receive()
        seqs = [seq for seq, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] == 0
        stored = events_of(batches, "BlockStored")
        tokens = [t for e in stored for t in e["token_ids"]]
        # prompt + 2 of the 3 generated tokens (the fake model adds 1) fill three blocks
        assert tokens == [*prompt, 20, 21]
        hashes = [h for e in stored for h in e["block_hashes"]]
        assert hashes == expected_chain(tokens)
        for event in stored:
            first = hashes.index(event["block_hashes"][0])
            assert event["parent_block_hash"] == (hashes[first - 1] if first else None)
            assert event["block_size"] == 4 and event["medium"] == "GPU"
            assert len(event["token_ids"]) == 4 * len(event["block_hashes"])
        # the same prompt again: its blocks are hits, nothing new is stored for them
        core.add_request("b", prompt, GREEDY)
        run_all(core)
        again = events_of(sub.receive(timeout_ms=1000) if sub.sub.poll(1000) else [], "BlockStored")
        assert not {h for e in again for h in e["block_hashes"]} & set(hashes[:2])
    finally:
        sub.close()
        core.shutdown()


def test_eviction_removes_and_reset_clears_then_replay_fills_a_gap() -> None:
    core, _ = make_core(num_blocks=8, kv_events_config=events_config())
    sub = Subscriber(core.kv_event_publisher)
    try:
        first = list(range(1, 17))  # 4 full blocks
        core.add_request("a", first, GREEDY)
        run_all(core)
        seen = sub.receive()
        a_hashes = [h for e in events_of(seen, "BlockStored") for h in e["block_hashes"]]
        # another prompt needs the pool: the least recently freed blocks go, each a BlockRemoved
        core.add_request("b", list(range(100, 124)), GREEDY)
        run_all(core)
        later = sub.receive()
        removed = [h for e in events_of(later, "BlockRemoved") for h in e["block_hashes"]]
        assert removed and set(removed) <= set(a_hashes)
        # a weight update forgets every cached block: one AllBlocksCleared
        core.swap_weights(lambda: None)
        cleared = sub.receive()
        assert [e["type"] for _, events in cleared for e in events] == ["AllBlocksCleared"]
        all_seen = seen + later + cleared
        # a subscriber that missed batches from 1 on asks the replay socket for them
        replayed = sub.replay(1)
        assert replayed == [(seq, events) for seq, events in all_seen if seq >= 1]
    finally:
        sub.close()
        core.shutdown()


def test_a_full_queue_drops_batches_without_blocking_the_engine() -> None:
    from jaxserve.engine.kv_event_publisher import ZmqEventPublisher

    publisher = ZmqEventPublisher(events_config(max_queue_size=1, replay_endpoint=None))
    try:
        start = time.perf_counter()
        for _ in range(2000):
            publisher.publish([AllBlocksCleared()])
        assert time.perf_counter() - start < 1.0
        assert publisher.num_dropped > 0
    finally:
        publisher.shutdown()
    # every batch was either sent or counted as dropped
    assert publisher.num_published + publisher.num_dropped == 2000


def test_events_off_records_nothing() -> None:
    for config in (None, KVEventsConfig(), events_config(publisher="null")):
        core, _ = make_core(kv_events_config=config)
        try:
            assert core.kv_event_publisher is None and core.kv.pool.events is None
            core.add_request("a", list(range(1, 10)), GREEDY)
            run_all(core)
        finally:
            core.shutdown()


def test_config_is_vllms_json() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config.publisher == "zmq" and config.endpoint == "tcp://*:5557"
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (10_000, 100_000, 100_000)
    assert config.replay_endpoint is None and config.event_encoding == "map"
    assert KVEventsConfig.from_json("{}").publisher == "null"
    for text, words in (
        ('{"enable_kv_cache_event": true}', "no field 'enable_kv_cache_event'"),
        ('{"publisher": "kafka"}', "publisher='kafka' must be one of null, zmq"),
        ('{"buffer_steps": 0}', "buffer_steps=0 must be >= 1"),
        ('{"hwm": "10"}', "hwm='10' has the wrong type"),
        ('{"event_encoding": "json"}', "event_encoding='json' must be one of map, array"),
        ("[1]", "must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            KVEventsConfig.from_json(text)


def test_the_server_publishes_the_blocks_of_a_completion() -> None:
    """The real fixture model behind HTTP: a completion's prompt comes back as BlockStored."""
    with tiny_server(
        "kv", max_model_len=64, block_size=4, num_gpu_blocks_override=32, warmup=False,
        kv_events_config=events_config(),
    ) as server:  # fmt: skip
        sub = Subscriber(server.engine.core.kv_event_publisher)
        try:
            prompt = list(range(5, 14))
            body = {"model": "kv", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            stored = events_of(sub.receive(), "BlockStored")
            tokens = [t for e in stored for t in e["token_ids"]]
            assert tokens[:8] == prompt[:8]
            hashes = [h for e in stored for h in e["block_hashes"]]
            assert hashes == expected_chain(tokens)
        finally:
            sub.close()


def test_benchmark_subscriber_counts_the_stream(tmp_path, monkeypatch) -> None:
    """benchmarks/kv_events_subscriber.py, the kv_events stage's drain, against a publisher."""
    import json
    import signal
    import sys
    import threading

    from benchmarks import kv_events_subscriber
    from jaxserve.engine.kv_event_publisher import ZmqEventPublisher

    publisher = ZmqEventPublisher(events_config(replay_endpoint=None))
    out = tmp_path / "subscriber.json"
    argv = ["kv_events_subscriber", "--endpoint", publisher.endpoint, "--seconds", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    stored = BlockStored([1], None, [1, 2, 3, 4], 4, [None])

    def send() -> None:
        for _ in range(3):
            publisher.publish([stored, BlockRemoved([1])])

    timer = threading.Timer(0.5, send)
    timer.start()
    on_sigterm = signal.getsignal(signal.SIGTERM)  # the script sets its own
    try:
        kv_events_subscriber.main()
    finally:
        signal.signal(signal.SIGTERM, on_sigterm)
        timer.cancel()
        publisher.shutdown()
    result = json.loads(out.read_text())
    assert result["batches"] == 3 and result["sequence_gaps"] == 0
    assert result["events"] == {"BlockStored": 3, "BlockRemoved": 3}


def test_the_flag_reaches_the_engine_config() -> None:
    import argparse

    from jaxserve.server.launch.flags import add_launch_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}'])
    config = engine_config_from_args(args).kv_events_config
    assert config is not None and config.is_publishing and config.endpoint == "tcp://*:5557"
    assert engine_config_from_args(parser.parse_args([])).kv_events_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-events-config", '{"publisher": "kafka"}'])
