"""``jaxserve.units.human_int``: the one parser of counts on every command line; and ``cdiv``,
the one ceiling division."""

from __future__ import annotations

import argparse
import math
import re

import pytest

from jaxserve.bench.capacity import add_capacity_arguments
from jaxserve.bench.latency import add_latency_arguments
from jaxserve.bench.throughput import add_throughput_arguments
from jaxserve.units import cdiv, human_bytes, human_count, human_int


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8192", 8192),
        (" 8192 ", 8192),
        ("8k", 8000),
        ("8K", 8192),
        ("128K", 131072),
        ("1.5k", 1500),
        ("1.5m", 1_500_000),
        ("2M", 2 * 1024**2),
        ("1g", 10**9),
        ("1G", 1024**3),
    ],
)
def test_human_int(text: str, value: int) -> None:
    assert human_int(text) == value


@pytest.mark.parametrize("text", ["", "k", "1.5", "1.5K", "1.0001k", "-1", "8 k", "1e3", "8x"])
def test_human_int_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
        human_int(text)


@pytest.mark.parametrize(
    "add_arguments", [add_capacity_arguments, add_throughput_arguments, add_latency_arguments]
)
def test_commands_read_token_counts_alike(add_arguments) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-model-len", "8K", "--max-num-batched-tokens", "2k"])
    assert (args.max_model_len, args.max_num_batched_tokens) == (8192, 2000)


def test_a_bad_count_names_the_flag_and_the_value(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_capacity_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", "8x"])
    assert "argument --max-model-len: '8x' is not a number like 8192" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("141GB", 141 * 10**9),
        ("80 GiB", 80 * 1024**3),
        ("512mib", 512 * 1024**2),
        ("1.5TB", 1_500 * 10**9),
        ("2M", 2 * 1024**2),  # human_int's forms: uppercase binary
        ("2m", 2 * 10**6),
        ("2097152", 2097152),
    ],
)
def test_human_bytes(text: str, value: int) -> None:
    assert human_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "GB", "1.5", "1.0000000001kB", "-1GB"])
def test_human_bytes_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
        human_bytes(text)


@pytest.mark.parametrize(
    ("count", "text"),
    [(8_030_261_248, "8.03B"), (4_196_352, "4.20M"), (48_100, "48.10K"), (900, "900")],
)
def test_human_count_shows_small_models_in_m_or_k(count: int, text: str) -> None:
    assert human_count(count) == text


def test_launch_and_capacity_read_max_model_len_alike() -> None:
    from jaxserve.cli import build_parser

    for text, value in (("8k", 8000), ("128k", 128_000), ("128K", 131_072), ("1.5k", 1500)):
        for command in ("launch", "capacity"):
            argv = [command, "--max-model-len", text]
            assert build_parser(argv).parse_args(argv).max_model_len == value, (command, text)


def test_help_states_the_k_rule(capsys) -> None:
    from jaxserve.cli import main

    for command in ("launch", "capacity"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "lowercase k is 1,000 and uppercase K is 1,024" in text, command


@pytest.mark.parametrize("b", [1, 2, 3, 16, 4096])
def test_cdiv_is_the_ceiling_of_the_quotient(b: int) -> None:
    for a in range(0, 3 * b + 2):
        assert cdiv(a, b) == math.ceil(a / b) == -(-a // b)
    assert cdiv(-1, b) == (0 if b > 1 else -1)  # the ceiling, for negative numerators too
