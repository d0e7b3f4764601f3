"""The ``jaxserve`` command as a vLLM user types it: ``serve MODEL`` (``launch`` an alias),
``--model``, ``--version``, ``python -m jaxserve``, close matches for unknown flags, vLLM's flags
(those that apply and those that do not), and errors that name flags, not Python fields.

Nothing here loads a model: every launch ends at validation, before the device is touched.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import __version__
from jaxserve.cli import build_parser, main
from jaxserve.flag_names import command_flags, in_flag_terms
from jaxserve.server.launch.flags import (
    add_launch_arguments,
    engine_config_from_args,
    settings_from_args,
)
from jaxserve.server.launch.vllm_flags import INAPPLICABLE_FLAGS

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "models" / "llama"


def parse(*argv: str):
    return build_parser(argv).parse_args(argv)


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def launch_errors(caplog, *argv: str) -> list[str]:
    """Run ``jaxserve serve`` with flags that fail validation; the error lines it logged."""
    caplog.set_level(logging.INFO)
    assert main(["serve", *argv]) in (1, 2)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_serve_and_launch_parse_alike():
    flags = (str(FIXTURE), "--max-model-len", "1k", "-tp", "2", "--port", "9000")
    serve, launch = parse("serve", *flags), parse("launch", *flags)
    assert serve.handler is launch.handler
    assert engine_config_from_args(serve) == engine_config_from_args(launch)
    assert serve.port == launch.port == 9000


def test_model_as_positional_or_flag(caplog):
    by_flag = engine_config_from_args(parse("serve", "--model", str(FIXTURE)))
    assert by_flag == engine_config_from_args(parse("serve", str(FIXTURE)))
    both = parse("serve", str(FIXTURE), "--model", str(FIXTURE))
    assert engine_config_from_args(both).model == str(FIXTURE)
    (message,) = launch_errors(caplog, "org/a", "--model", "org/b")
    assert message == "MODEL 'org/a' and --model 'org/b' differ: give the model once"


def test_version_and_python_dash_m(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"jaxserve {__version__} (jax ")
    done = subprocess.run(
        [sys.executable, "-m", "jaxserve", "--version"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.startswith(f"jaxserve {__version__}")


@pytest.mark.parametrize(
    ("argv", "usage", "said"),
    [
        (
            ["serve", "--max-model-length", "8192"],
            "usage: jaxserve serve [MODEL] [flags]",
            "unrecognized argument --max-model-length; did you mean --max-model-len?",
        ),
        (
            ["launch", "--gpu-memory-utilisation=0.5"],
            "usage: jaxserve serve [MODEL] [flags]",
            "unrecognized argument --gpu-memory-utilisation; did you mean --gpu-memory-utilization",
        ),
        (
            ["capacity", "--max-num-sqs", "4"],
            "usage: jaxserve capacity",
            "unrecognized argument --max-num-sqs; did you mean --max-num-seqs?",
        ),
        (
            ["bench", "serve", "--requests-rates", "4"],
            "usage: jaxserve bench serve",
            "unrecognized argument --requests-rates; did you mean --request-rates",
        ),
        (["serve", "a", "b"], "usage: jaxserve serve", "unrecognized argument b\n"),
    ],
)
def test_an_unknown_flag_gets_its_commands_usage_and_a_suggestion(capsys, argv, usage, said):
    err = usage_error(capsys, *argv)
    assert err.startswith(usage) and said in err and "--help` lists every flag" in err


@pytest.mark.parametrize("port", ["80000", "-1", "http"])
def test_a_port_out_of_range_is_a_usage_error(capsys, port):
    err = usage_error(capsys, "serve", "--port", port)
    assert "argument --port: " in err and "is not a port number (0-65535)" in err
    assert "Traceback" not in err


def test_vllm_flags_that_apply_reach_the_configs(tmp_path):
    args = parse(
        "serve", "org/name", "--revision", "v1", "--tokenizer", "org/tok",
        "--tokenizer-revision", "t1", "--download-dir", str(tmp_path), "--dtype", "half",
        "--load-format", "safetensors", "--disable-log-requests", "--disable-log-stats",
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", "--seed", "7",
        "--served-model-name", "m", "--max-num-batched-tokens", "4k",
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert (config.model, config.revision, config.tokenizer) == ("org/name", "v1", "org/tok")
    assert (config.tokenizer_revision, config.download_dir) == ("t1", str(tmp_path))
    assert (config.dtype, config.load_format, config.seed) == ("float16", "auto", 7)
    assert config.max_num_batched_tokens == 4000 and config.model_name == "m"
    settings = settings_from_args(args, config.model_name)
    assert not settings.enable_log_requests and not settings.log_stats
    assert args.uvicorn_log_level == "warning" and args.disable_uvicorn_access_log
    assert parse("serve", "--dtype", "float").dtype == "float32"
    assert not parse("serve").enable_log_requests and parse("serve").log_level == "info"


def test_vllm_flags_that_do_not_apply_warn_once_each(caplog):
    caplog.set_level(logging.WARNING)
    # --max-num-seqs 0 stops the start at validation, after the warnings.
    main(["serve", "--trust-remote-code", "--enforce-eager", "--swap-space", "4",
          "--no-disable-custom-all-reduce", "-pp", "1", "-O3", "--max-num-seqs", "0"])  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    ignored = [line for line in warnings if "does not apply to jaxserve" in line]
    assert [line.split()[0] for line in ignored] == [
        "--trust-remote-code",
        "--enforce-eager",
        "--compilation-config",
        "--swap-space",
    ]
    assert "no code from a model repository is ever run" in ignored[0]


def test_a_vllm_flag_whose_other_values_would_change_the_model_refuses_them(capsys):
    err = usage_error(capsys, "serve", "--pipeline-parallel-size", "2")
    assert "argument --pipeline-parallel-size/-pp: 2: only 1 is accepted" in err
    assert "--tensor-parallel-size" in err


def test_docs_list_every_vllm_flag_that_does_not_apply():
    text = (ROOT / "docs" / "cli.md").read_text()
    for flag in INAPPLICABLE_FLAGS:
        assert f"`{flag.names[0]}`" in text, flag.names[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5 must be in (0, 1]"),
        (["--max-num-seqs", "0"], "--max-num-seqs 0 must be at least 1"),
        (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens 8 must be at least 16"),
        (["--block-size", "12"], "--block-size 12 must be a power of two"),
        (["--max-model-len", "1"], "--max-model-len 1 must be at least 2"),
        (["--num-gpu-blocks-override", "1"], "--num-gpu-blocks-override 1 must be at least 2"),
        (["--grammar-compile-timeout", "0"], "--grammar-compile-timeout 0.0 must be positive"),
        (["-tp", "0"], "--tensor-parallel-size 0 must be >= 1"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout -1.0 must be >= 0"),
        (["--request-body-timeout", "0"], "--request-body-timeout 0.0 must be > 0"),
        (["--send-timeout", "0"], "--send-timeout 0.0 must be > 0"),
        (["--max-request-body-bytes", "10"], "--max-request-body-bytes 10 must be at least 1024"),
        (["--max-seqs-per-request", "0"], "--max-seqs-per-request 0 must be an integer >= 1"),
        (["--rate-limit-rpm", "0"], "--rate-limit-rpm 0 must be None (no limit) or an integer"),
        (["--max-queued-requests", "0"], "--max-queued-requests 0 must be >= 1"),
        (["--num-processes", "0"], "--num-processes 0 must be >= 1"),
        (
            ["--num-processes", "2", "--process-id", "2", "--coordinator-address", "h:1"],
            "--process-id 2 must be in [0, --num-processes 2)",
        ),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--api-key", ""], "--api-key is empty"),
    ],
)
def test_validation_errors_name_the_flag(caplog, flags, message):
    (error,) = launch_errors(caplog, *flags)
    assert error.startswith(message), error
    assert not re.search(r"(?<![\w-])[a-z]+_[a-z_]+", error.split("(")[0]), error


def test_errors_from_loading_name_flags_too():
    flags = command_flags(add_launch_arguments)
    assert in_flag_terms("tensor_parallel_size=4 must divide num_kv_heads=2", flags) == (
        "--tensor-parallel-size 4 must divide num_kv_heads=2"
    )
    assert in_flag_terms("max_model_len=8,192 needs 600 KV blocks", flags).startswith(
        "--max-model-len 8,192 needs"
    )
    assert in_flag_terms("dtype='x' is not the model's dtype", flags) == (
        "--dtype 'x' is not the model's dtype"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5 must be in (0, 1]"),
        (["-tp", "0"], "--tensor-parallel-size 0 must be >= 1"),
        (["--block-size", "12"], "--block-size 12 must be a power of two"),
    ],
)
def test_capacity_checks_what_serve_checks_and_names_the_flag(capsys, flags, message):
    assert main(["capacity", *flags, "--device-memory", "80GB"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_offline_benchmarks_name_the_flag():
    with pytest.raises(SystemExit, match=r"^error: --max-model-len 1 must be at least 2$"):
        main(["bench", "throughput", "--engine", "jaxserve", "--max-model-len", "1"])


def test_bench_serve_names_the_flag(capsys):
    assert main(["bench", "serve", "--max-concurrency", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --max-concurrency 0 must be >= 1"
