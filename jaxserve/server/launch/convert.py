"""``jaxserve convert MODEL_DIR OUT``: a model's weights as they are served (cast, fused,
quantized), written with orbax-checkpoint beside its config and tokenizer files, so that
``jaxserve serve OUT`` restores them straight into the devices' shards (docs/checkpoints.md).

The flags that decide how the weights are served are ``serve``'s own (``flags.py``); the work is
``runner/convert.py``'s, imported (with JAX) only when the command runs.
"""

from __future__ import annotations

import argparse
import logging

from jaxserve.engine_config import EngineConfig
from jaxserve.server.launch.flags import add_launch_arguments_named, flag_terms

_LOG = logging.getLogger(__name__)
# serve's flags that convert takes: how the weights are made, and where a model id is found.
CONVERT_FLAGS = (
    "dtype",
    "quantization",
    "tensor_parallel_size",
    "revision",
    "download_dir",
)


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "The flags mean what they mean to `serve`, which then serves OUT with the same ones (or "
        "none). --dtype auto is what serve would use on this machine (float32 on a CPU): "
        "converting on a CPU host for a GPU, give --dtype bfloat16. With "
        "--tensor-parallel-size 1 (and no quantization) q/k/v and gate/up are written fused, "
        "the one-device layout; convert with the tensor-parallel size you will serve with."
    )
    parser.add_argument(
        "model",
        metavar="MODEL_DIR",
        help="the model to convert: a local Hugging Face directory (safetensors), or a model id "
        "(org/name) in the local Hugging Face cache",
    )
    parser.add_argument(
        "out",
        metavar="OUT",
        help="the directory to write (new or empty): the weights with orbax, config.json, "
        "generation_config.json, the tokenizer's files and jaxserve_checkpoint.json; "
        "`jaxserve serve OUT` serves it",
    )
    add_launch_arguments_named(parser, CONVERT_FLAGS)
    parser.add_argument(
        "--disable-tqdm",
        action="store_true",
        help="no progress bar while the weights are written",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error", "critical"),
        help="log level",
    )


def run_convert(args: argparse.Namespace) -> int:
    """0 once OUT holds the converted checkpoint; 2 for flags or directories that cannot
    convert, 1 when the weights cannot be made."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    from jaxserve.runner.devices import quiet_backend_probe

    quiet_backend_probe()  # before JAX's backend starts
    from jaxserve.models.loading.checkpoint_reader import WeightsError
    from jaxserve.runner.convert import convert

    try:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            tensor_parallel_size=args.tensor_parallel_size,
            revision=args.revision,
            download_dir=args.download_dir,
        )
        convert(config, args.out, show_progress=not args.disable_tqdm)
    except (OSError, WeightsError) as exc:
        _LOG.error("Cannot convert %s: %s", args.model, exc)
        return 1 if isinstance(exc, WeightsError) else 2
    except ValueError as exc:  # a flag, or a model that does not convert
        _LOG.error("Cannot convert %s: %s", args.model, flag_terms(exc))
        return 2
    return 0
