"""Slow clients, many clients and shutdown, for `vlmrl serve` on uvicorn.

uvicorn bounds the time between a connection's requests (`timeout_keep_alive`) and SIGTERM's wait for requests in
flight (`timeout_graceful_shutdown`), but not the time a client may take to send a request's headers, nor the number
of open connections: a client that sends a header byte now and then, or opens connections and sends nothing, holds
them forever, and enough of them exhaust the process's open files. `GuardedH11` (uvicorn's h11 protocol) adds both:

- a header deadline (`header_timeout`) from the moment a connection opens or its previous response ends to the end
  of the next request's headers; past it the connection is closed;
- a connection cap (`max_connections`): one more connection is answered 503 with a one-line reason and closed at
  once, before it can hold anything; `run` raises the process's open-files limit to fit the cap (or lowers the cap,
  saying so) so that accepting never fails.

The body has its own deadline in vlmrl.serve.gate (a 408). `run` is what `vlmrl serve` calls.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from vlmrl.serve.guard import ServeLimits, error_body

SPARE_FILES = 128  # open files the process keeps for itself (model files, logs, sockets) beside the connections


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (module docstring). `header_timeout` and
    `max_connections` are set on a subclass per server (`guarded_protocol`); `cut` counts connections closed."""

    header_timeout: float = 10.0
    max_connections: int = 1024
    cut = {"slow_headers": 0, "over_cap": 0}

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        if len(self.connections) > self.max_connections:
            self.cut["over_cap"] += 1
            body = json.dumps(error_body(503, f"the server has {self.max_connections} connections open, its limit "
                                              "(--max-connections); retry after 1 s")).encode()
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                            b"retry-after: 1\r\nconnection: close\r\ncontent-length: " + str(len(body)).encode() +
                            b"\r\n\r\n" + body)
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.cut["slow_headers"] += 1
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are in: its body has the gate's deadline
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # the next request's headers (armed first: a pipelined request starts in super()'s call)
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_protocol(limits: ServeLimits) -> type[GuardedH11]:
    """A `GuardedH11` with this server's deadline and cap (its own `cut` counters)."""
    return type("GuardedH11", (GuardedH11,), {"header_timeout": limits.header_timeout,
                                               "max_connections": limits.max_connections,
                                               "cut": {"slow_headers": 0, "over_cap": 0}})


def fit_open_files(connections: int) -> int:
    """Raise the soft open-files limit toward what `connections` need (up to the hard limit); the connections that
    fit, which is fewer than asked where the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    return connections if soft == resource.RLIM_INFINITY else min(connections, soft - SPARE_FILES)


def server_config(app: Any, host: str, port: int, limits: ServeLimits, log_level: str = "info"):
    """The uvicorn Config `vlmrl serve` runs: the guarded protocol, keep-alive 5 s, SIGTERM's drain deadline."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=guarded_protocol(limits),
                          timeout_keep_alive=5, timeout_graceful_shutdown=limits.shutdown_timeout,
                          h11_max_incomplete_event_size=64 * 2**10)


def run(app: Any, host: str, port: int, limits: ServeLimits) -> None:
    """Serve `app` until SIGINT/SIGTERM (which drains requests in flight for at most `limits.shutdown_timeout`)."""
    import dataclasses

    import uvicorn

    fits = fit_open_files(limits.max_connections)
    if fits < limits.max_connections:
        print(f"--max-connections {limits.max_connections}: the open-files limit (ulimit -n) leaves room for {fits}; "
              f"serving with --max-connections {fits}", file=sys.stderr)
        limits = dataclasses.replace(limits, max_connections=max(1, fits))
    uvicorn.Server(server_config(app, host, port, limits)).run()
