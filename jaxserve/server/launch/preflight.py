"""What ``jaxserve launch`` checks before it loads anything, so a start that cannot succeed
ends in seconds, not after minutes of loading and compiling.

- The address: a port another server listens on, or an address this machine does not have.
- The device: free memory against what ``--gpu-memory-utilization`` asks for
  (``runner/device_memory.py``), before JAX's backend starts and takes it.
- An open door: all interfaces with no API key is allowed (containers need it) but warned of,
  by ``launch`` once the server starts (``warn_if_open``): a start that fails says only why.
"""

from __future__ import annotations

import errno
import logging
import socket

from jaxserve.engine_config import EngineConfig
from jaxserve.runner.device_memory import DeviceMemoryError, MemoryQuery, check_free_memory
from jaxserve.server.settings import ServerSettings

_LOG = logging.getLogger("jaxserve.launch")
ALL_INTERFACES = ("0.0.0.0", "::", "")


class PreflightError(RuntimeError):
    """A start-up that cannot succeed; the message says why and what to change."""


def check_address(host: str, port: int) -> None:
    """Raise ``PreflightError`` unless uvicorn will be able to bind ``host:port``.

    NOTE: bind, then release. Holding the socket through loading would not keep the port:
    with SO_REUSEADDR (which uvicorn sets, so a restart can rebind at once) Linux lets another
    socket bind it until one listens, and listening early would let the kernel accept
    connections that then wait minutes for the model. A server already listening there, the
    case that matters, is found either way; uvicorn binds again with the same options.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            reason = "another process is listening there (a server already running?)"
            fix = "stop it or choose another --port"
        elif exc.errno == errno.EACCES:
            reason = "this user may not bind it"
            fix = "choose a --port above 1023"
        else:
            reason = exc.strerror or str(exc)
            fix = "check --host (an address of this machine, 127.0.0.1 or 0.0.0.0)"
        raise PreflightError(f"Cannot listen on {host}:{port}: {reason}; {fix}") from None


def warn_if_open(host: str, port: int, settings: ServerSettings) -> None:
    if host in ALL_INTERFACES and settings.api_key is None:
        _LOG.warning(
            "Listening on all interfaces (--host %s) with no API key: anyone who can reach "
            "port %d of this machine can use the model. Pass --api-key KEY (or set "
            "$JAXSERVE_API_KEY), or --host 127.0.0.1 to serve this machine only.",
            host or "''",
            port,
        )


def preflight(
    host: str,
    port: int,
    config: EngineConfig,
    memory_query: MemoryQuery,
    serves_http: bool = True,
) -> None:
    """Raise ``PreflightError`` if the address or the device will not serve. Call before the
    model loads (and before anything touches a device). A follower of a multi-host replica
    (``serves_http`` false) checks only its devices."""
    if serves_http:
        check_address(host, port)
    try:
        check_free_memory(config.gpu_memory_utilization, memory_query)
    except DeviceMemoryError as exc:
        raise PreflightError(str(exc)) from None
