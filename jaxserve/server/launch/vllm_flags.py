"""vLLM's ``serve`` flags that have no meaning in jaxserve, in one table: each is accepted, so a
command line written for ``vllm serve`` starts, and says in one warning line why it does nothing
here; the few whose other values would change what is served accept only the value that does
not (``-pp 1``), and any other value ends the start with the reason.

The vLLM flags that do mean something here are ``jaxserve serve``'s own flags, under vLLM's names
(``flags.py``); docs/cli.md lists both. ``add_vllm_flags`` adds this table to the ``serve``
parser; ``run_launch`` logs ``inapplicable_flag_warnings``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class InapplicableFlag:
    names: tuple[str, ...]  # vLLM's spellings, the long one first
    reason: str  # why it does not apply, said after "does not apply to jaxserve: "
    metavar: str | None = None  # None: a switch (--flag / --no-flag); else takes a value
    nargs: str | None = None  # for a value: "+" when vLLM takes several
    only: str | None = None  # the one value accepted (the one that changes nothing)

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


INAPPLICABLE_FLAGS = (
    InapplicableFlag(
        ("--trust-remote-code",),
        "no code from a model repository is ever run; the architectures jaxserve serves are "
        "written in jaxserve (README: Serving a real model)",
    ),
    InapplicableFlag(
        ("--code-revision",),
        "no code from a model repository is ever run (see --revision for the weights)",
        metavar="REVISION",
    ),
    InapplicableFlag(
        ("--enforce-eager",),
        "there is no eager mode or CUDA graph to turn off: every step runs as an XLA program "
        "compiled once per shape bucket",
    ),
    InapplicableFlag(
        ("--cuda-graph-sizes",),
        "no CUDA graphs are captured: XLA compiles one program per shape bucket",
        metavar="SIZE",
        nargs="+",
    ),
    InapplicableFlag(
        ("--max-seq-len-to-capture",),
        "no CUDA graphs are captured: XLA compiles one program per shape bucket",
        metavar="TOKENS",
    ),
    InapplicableFlag(
        ("--compilation-config", "-O"),
        "there is no torch.compile: XLA compiles every step (--compilation-cache-dir keeps "
        "the programs)",
        metavar="CONFIG",
    ),
    InapplicableFlag(
        ("--swap-space",),
        "preempted requests are recomputed, never swapped to host memory",
        metavar="GIB",
    ),
    InapplicableFlag(
        ("--cpu-offload-gb",),
        "weights stay in device memory; nothing is offloaded to the host",
        metavar="GIB",
    ),
    InapplicableFlag(
        ("--tokenizer-mode",),
        "the model's tokenizer always loads through transformers' AutoTokenizer (the fast "
        "one where the model ships it); there is no slow or mistral mode",
        metavar="MODE",
    ),
    InapplicableFlag(
        ("--max-logprobs",),
        "the limit is fixed at 20 (vLLM's default): the sampler is compiled for 20 top "
        "logprobs and a request asking for more gets a 400",
        metavar="N",
    ),
    InapplicableFlag(
        ("--hf-token",),
        "nothing is downloaded: a model id is read from the local Hugging Face cache",
        metavar="TOKEN",
    ),
    InapplicableFlag(
        ("--disable-custom-all-reduce",),
        "tensor parallelism runs on XLA's collectives; there is no custom all-reduce",
    ),
    InapplicableFlag(
        ("--distributed-executor-backend",),
        "one process drives every device of a host, and hosts join through "
        "--coordinator-address: there is no Ray or multiprocessing executor",
        metavar="BACKEND",
    ),
    InapplicableFlag(
        ("--disable-frontend-multiprocessing",),
        "the HTTP server and the engine already run in one process",
    ),
    InapplicableFlag(
        ("--pipeline-parallel-size", "-pp"),
        "jaxserve has no pipeline parallelism: split a model with --tensor-parallel-size "
        "(over hosts: --num-processes), or run replicas behind a load balancer",
        metavar="N",
        only="1",
    ),
)


def _only(flag: InapplicableFlag) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text != flag.only:
            raise argparse.ArgumentTypeError(f"{text}: only {flag.only} is accepted; {flag.reason}")
        return text

    return parse


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "vLLM flags that do not apply",
        "accepted so that a `vllm serve` command line starts; each one given logs a warning "
        "that says why it changes nothing (docs/cli.md)",
    )
    for flag in INAPPLICABLE_FLAGS:
        if flag.metavar is None:
            group.add_argument(
                *flag.names,
                dest=flag.dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=flag.reason,
            )
        else:
            group.add_argument(
                *flag.names,
                dest=flag.dest,
                metavar=flag.metavar,
                nargs=flag.nargs,
                type=_only(flag) if flag.only else str,
                default=None,
                help=(f"only {flag.only}: " if flag.only else "") + flag.reason,
            )


def inapplicable_flag_warnings(args: argparse.Namespace) -> list[str]:
    """One line per flag of the table that was given (a switch given as --no-X changes nothing
    and says nothing)."""
    lines = []
    for flag in INAPPLICABLE_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None or value is False or (flag.only and value == flag.only):
            continue
        lines.append(f"{flag.names[0]} does not apply to jaxserve (ignored): {flag.reason}")
    return lines
