"""Processes 1..N-1 of a multi-host replica: load the same model, then join every step.

Process 0 runs the server, the scheduler and the KV block manager (``EngineCore``); each step
its runner broadcasts the step's inputs, and the runners here execute the same jitted step on
their devices. Start them with the same model and engine flags as process 0.
"""

from __future__ import annotations

import logging

import jax

from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.runner.runner import ModelRunner

_LOG = logging.getLogger(__name__)


def run_follower(config: EngineConfig) -> None:
    model_config = load_model_config(config.model_dir)
    runner = ModelRunner(model_config, config)  # sampling happens, but only process 0 reads it
    if config.warmup:  # process 0 warms up the same buckets in the same order
        try:
            runner.warmup()
        except BaseException:  # the weights stop loading, the compiles stop
            runner.shutdown()
            raise
    _LOG.info("Process %d follows process 0's steps", jax.process_index())
    runner.follow()
    _LOG.info("Process %d: process 0 stopped", jax.process_index())
