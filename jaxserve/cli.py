"""The ``jaxserve`` command (also ``python -m jaxserve``): ``serve`` (the server, as ``vllm
serve``; ``launch`` is its older name), ``capacity`` (how much KV cache fits), ``bench serve``
(load a running server), ``convert`` (a model's served weights to an orbax checkpoint),
``bench throughput`` (offline tokens/s) and ``bench latency`` (offline
latency of one batch).

Each subcommand's module is imported only when that subcommand runs, so ``jaxserve --help`` and
``jaxserve serve`` stay light. Add a subcommand with ``_add_command``. An unknown flag is reported
by the subcommand that got it, with the flags it may have meant (``CommandParser``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

Handler = Callable[[argparse.Namespace], int]
SERVE_ALIASES = ("serve", "launch")


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, except that arguments it does not know are an error of this parser
    (its usage, not the top-level one's) that names each and suggests close matches:
    ``unrecognized argument --max-model-length; did you mean --max-model-len?``."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized_message(extras))
        assert parsed is not None
        return parsed, extras

    def unrecognized_message(self, extras: Sequence[str]) -> str:
        flags = [name for action in self._actions for name in action.option_strings]
        # The values of unknown flags are left over too: name only the flags, when any.
        named = [arg for arg in extras if arg.startswith("-")] or list(extras)
        parts = []
        for arg in named:
            name = arg.split("=", 1)[0]
            close = difflib.get_close_matches(name, flags, n=3, cutoff=0.6)
            suggestion = f"; did you mean {' or '.join(close)}?" if close else ""
            parts.append(f"unrecognized argument {name}{suggestion}")
        return "\n".join(parts) + f"\n(`{self.prog} --help` lists every flag)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default, except empty ones (whose help text says what happens) and those of
    flags that take no value (``--disable-tqdm`` showed "(default: True)": the default of the
    setting it turns off, not of the flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, "", argparse.SUPPRESS):
            return action.help
        if isinstance(action, argparse._StoreConstAction):  # store_true / store_false
            return action.help
        return super()._get_help_string(action)


def _add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    help_text: str,
    aliases: Sequence[str] = (),
    usage: str | None = None,
) -> argparse.ArgumentParser:
    return subparsers.add_parser(
        name,
        aliases=list(aliases),
        help=help_text,
        description=help_text,
        usage=usage,
        formatter_class=_HelpFormatter,
    )


def version() -> str:
    """``jaxserve --version``: this package's version and the JAX it runs on."""
    from jaxserve import __version__

    try:
        jax_version = metadata.version("jax")
    except metadata.PackageNotFoundError:
        jax_version = "not installed"
    return f"jaxserve {__version__} (jax {jax_version}, Python {sys.version.split()[0]})"


def hide_torch() -> None:
    """Make torch look absent to this process, before anything imports it. The server never
    runs torch, but where it is installed transformers imports it (and torchvision) for every
    config and tokenizer it reads: 5-9 s of each start on the H200 host (a ``None`` entry in
    ``sys.modules`` makes importlib's ``find_spec``, which transformers asks, report it
    absent). Not for ``bench throughput``, whose Hugging Face engine runs torch."""
    if "torch" not in sys.modules:
        for name in ("torch", "torchvision", "torchaudio"):
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def _run_serve(args: argparse.Namespace) -> int:
    hide_torch()
    from jaxserve.server.launch.serve import run_launch

    return run_launch(args)


def _run_batch(args: argparse.Namespace) -> int:
    hide_torch()
    from jaxserve.server.launch.run_batch import run_batch

    return run_batch(args)


def _run_convert(args: argparse.Namespace) -> int:
    hide_torch()
    from jaxserve.server.launch.convert import run_convert

    return run_convert(args)


def _run_bench_serve(args: argparse.Namespace) -> int:
    from jaxserve.bench.serve import run_serve

    return run_serve(args)


def _run_capacity(args: argparse.Namespace) -> int:
    hide_torch()
    from jaxserve.bench.capacity import run_capacity

    return run_capacity(args)


def _run_bench_throughput(args: argparse.Namespace) -> int:
    from jaxserve.bench.throughput import run_throughput

    return run_throughput(args)


def _run_bench_latency(args: argparse.Namespace) -> int:
    hide_torch()
    from jaxserve.bench.latency import run_latency

    return run_latency(args)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` gets (and imports) its arguments."""
    parser = CommandParser(
        prog="jaxserve",
        description="LLM serving engine in JAX with an OpenAI-compatible server. "
        "`jaxserve serve MODEL` serves a model as `vllm serve MODEL` does.",
    )
    parser.add_argument("--version", action="version", version=version())
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=CommandParser
    )

    serve = _add_command(
        commands,
        "serve",
        "serve a model over an OpenAI-compatible HTTP API (`launch` is an older name for it)",
        aliases=["launch"],
        usage="%(prog)s [MODEL] [flags]",
    )
    serve.set_defaults(handler=_run_serve)
    if argv[:1] and argv[0] in SERVE_ALIASES:
        from jaxserve.server.launch.flags import add_launch_arguments

        add_launch_arguments(serve)

    run_batch = _add_command(
        commands,
        "run-batch",
        "run an OpenAI batch file (JSON lines) through a model offline, as `vllm run-batch`",
        usage="%(prog)s -i INPUT.jsonl -o OUTPUT.jsonl [MODEL] [flags]",
    )
    run_batch.set_defaults(handler=_run_batch)
    if argv[:1] == ["run-batch"]:
        from jaxserve.server.launch.run_batch import add_run_batch_arguments

        add_run_batch_arguments(run_batch)

    capacity = _add_command(
        commands,
        "capacity",
        "print KV cache capacity and max concurrency without loading weights",
        usage="%(prog)s [MODEL] [flags]",
    )
    capacity.set_defaults(handler=_run_capacity)
    if argv[:1] == ["capacity"]:
        from jaxserve.bench.capacity import add_capacity_arguments

        add_capacity_arguments(capacity)

    convert = _add_command(
        commands,
        "convert",
        "write a model's weights as they are served (cast, fused, quantized) to an orbax "
        "checkpoint that `serve OUT` restores straight into the devices' shards",
        usage="%(prog)s MODEL_DIR OUT [--dtype DTYPE] [--quantization fp8|int8] [flags]",
    )
    convert.set_defaults(handler=_run_convert)
    if argv[:1] == ["convert"]:
        from jaxserve.server.launch.convert import add_convert_arguments

        add_convert_arguments(convert)

    bench = commands.add_parser("bench", help="benchmarks", description="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    bench_serve = _add_command(
        bench_commands,
        "serve",
        "replay prompts against a running server and report latencies",
        usage="%(prog)s [flags]",
    )
    bench_serve.set_defaults(handler=_run_bench_serve)
    if argv[:2] == ["bench", "serve"]:
        from jaxserve.bench.serve import add_serve_arguments

        add_serve_arguments(bench_serve)
    throughput = _add_command(
        bench_commands,
        "throughput",
        "offline output tokens/s, against Hugging Face transformers",
        usage="%(prog)s [flags]",
    )
    throughput.set_defaults(handler=_run_bench_throughput)
    if argv[:2] == ["bench", "throughput"]:
        from jaxserve.bench.throughput import add_throughput_arguments

        add_throughput_arguments(throughput)
    latency = _add_command(
        bench_commands,
        "latency",
        "offline latency of one batch: end to end, TTFT, TPOT",
        usage="%(prog)s [flags]",
    )
    latency.set_defaults(handler=_run_bench_latency)
    if argv[:2] == ["bench", "latency"]:
        from jaxserve.bench.latency import add_latency_arguments

        add_latency_arguments(latency)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # transformers warns at import that PyTorch is absent; jaxserve never needs it.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        # Ctrl-C while a model loads or a benchmark runs (``launch`` serving handles its
        # own): what was starting has stopped (the engine cancels its weight load and
        # compiles); a second Ctrl-C while the interpreter winds down ends the process.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print("Interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
