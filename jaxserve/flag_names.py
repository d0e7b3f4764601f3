"""Error messages in the command line's words.

EngineConfig, ServerSettings, DistributedConfig and the runner name the Python fields they check
(``gpu_memory_utilization=1.5 must be in (0, 1]``), as ``jaxserve.LLM`` users spell them.
``jaxserve serve`` passes its errors through ``in_flag_terms``, which names the flag instead
(``--gpu-memory-utilization 1.5 must be in (0, 1]``), so the message says what to change on the
command line. The map comes from the parser itself: a new flag is covered when it is added.
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable

# Fields whose flag is not the field's name in kebab case (ServerSettings' *_s seconds, ...).
_RENAMED_FIELDS = {
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "served_model_names": "--served-model-name",
    "grammar_compile_timeout_s": "--grammar-compile-timeout",
    "shutdown_timeout_s": "--shutdown-timeout",
    "request_body_timeout_s": "--request-body-timeout",
    "send_timeout_s": "--send-timeout",
    "coordinator_address": "--coordinator-address",
}


def field_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each field (an argparse ``dest``) -> the first long flag that sets it."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        names = [name for name in action.option_strings if name.startswith("--")]
        if names and action.dest != "help":
            flags.setdefault(action.dest, names[0])
    return {**flags, **_RENAMED_FIELDS}


@functools.cache
def command_flags(add_arguments: Callable[[argparse.ArgumentParser], None]) -> dict[str, str]:
    """``field_flags`` of the parser that ``add_arguments`` fills (a subcommand's)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return field_flags(parser)


def in_flag_terms(message: str, flags: dict[str, str]) -> str:
    """``message`` with each ``field=value`` written ``--flag value``, and each other mention
    of a snake_case field written as its flag (a one-word field is left alone where it is not
    followed by ``=``: it may be a plain word of the sentence)."""
    for field in sorted(flags, key=len, reverse=True):
        flag = flags[field]
        message = re.sub(rf"(?<![\w-]){field}=", f"{flag} ", message)
        if "_" in field:
            message = re.sub(rf"(?<![\w-]){field}(?!\w)", flag, message)
    return message
