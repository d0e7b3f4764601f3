"""``/health`` as each orchestrator reads it (docs/scaling.md, "Health and readiness"): 200 from
the moment the port opens, which is after the weights are loaded and the first buckets compiled,
also while the other buckets compile in the background; 503 once the server drains (SIGTERM:
``test_server_launch.test_sigterm_drains_then_exits_zero``) or an engine loop has died, for one
engine, for data-parallel replicas (any replica dead) and for a Ray Serve replica
(``check_health`` raises, so Ray replaces it)."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import httpx
import pytest

from jaxserve.engine.balancer import Balancer
from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.server.api.errors import APIError
from jaxserve.server.lifecycle import ServerState
from tests.conftest import tiny_server
from tests.test_serve_while_compiling import held_background  # noqa: F401 (a fixture)


def test_health_is_200_and_requests_are_served_while_buckets_compile(held_background):  # noqa: F811
    with tiny_server(
        "m",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=4,
        num_gpu_blocks_override=64,
        serve_while_compiling=True,
    ) as server:
        runner = server.engine.core.runner
        assert runner.ready_tokens == 16  # the larger buckets are held back, not compiled
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        body = {"model": "m", "prompt": [5] * 40, "max_tokens": 2, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 2
        assert runner.ready_tokens == 16
        held_background.set()
        runner.programs.background.thread.join(120)
        assert runner.ready_tokens == 64
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@dataclasses.dataclass
class Replica:
    is_alive: bool = True
    dead_error: BaseException | None = None
    is_sleeping: bool = False
    config: object = None
    tokenizer: object = None
    max_model_len: int = 64


def test_data_parallel_readiness_needs_every_replica():
    replicas = [Replica(), Replica()]
    state = ServerState(DataParallelEngine(replicas, Balancer(2, block_size=16)))
    assert state.is_ready
    state.admit()
    replicas[1].is_alive, replicas[1].dead_error = False, RuntimeError("device lost")
    assert not state.is_ready
    with pytest.raises(APIError) as error:
        state.admit()
    assert error.value.status == 503
    assert "device lost" in repr(state.engine.dead_error)


def test_a_ray_replica_fails_its_health_check_once_its_engine_died():
    pytest.importorskip("ray")
    from jaxserve.integrations.ray import JaxserveReplica

    check_health = JaxserveReplica.func_or_class.check_health  # what Ray calls each period
    replica = types.SimpleNamespace(engine=Replica())
    asyncio.run(check_health(replica))  # alive: passes
    replica.engine.is_alive, replica.engine.dead_error = False, RuntimeError("boom")
    with pytest.raises(RuntimeError, match="engine loop is not running: RuntimeError"):
        asyncio.run(check_health(replica))
