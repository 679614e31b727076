"""Listening and stopping: the socket is bound before the model loads (a taken port is one error line
at once), every request while the model loads is answered 503 "Loading model" (``LoadingAnswers``),
uvicorn serves the app, and SIGINT/SIGTERM stop the server cleanly with exit status 0.

On the first signal the listener closes, idle connections close, new requests on open connections
get a 503, and requests in flight have ``shutdown_timeout`` seconds to finish; then the scheduler
cancels the rest, and each of them is answered with a 503 error (an error event in a stream). A
second Ctrl-C stops at once. uvicorn re-raises the signal after a graceful stop so that the process
dies by it; `serve` returns instead, so the exit status says the server stopped as asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import uvicorn

from saem_gguf.errors import SaemError

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from saem_gguf.serving.app import ServerState

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
BACKLOG = 2048  # uvicorn's default


@dataclass(frozen=True)
class ListenConfig:
    host: str
    port: int  # 0: a free port, chosen by the system
    shutdown_timeout: float  # seconds in-flight requests may take to finish after a stop signal
    verbose: bool = False  # uvicorn's info log and access log


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or a SaemError saying why not."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise SaemError(f"--host {host}: not an address this machine can listen on ({e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        why = {errno.EADDRINUSE: "the address is already in use",
               errno.EACCES: "permission denied (ports below 1024 need privileges)",
               errno.EADDRNOTAVAIL: "the address is not one of this machine's"}.get(e.errno, e.strerror)
        raise SaemError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


LOADING_BODY = json.dumps({"error": {"message": "Loading model", "type": "unavailable_error",
                                     "code": "loading_model"}}).encode()
STOP_GRACE_S = 0.25  # LoadingAnswers.stop: how long a connection it accepted has to send its request


async def _loading_app(scope, receive, send) -> None:
    """Every HTTP request: 503 "Loading model", and the connection closed, so that no client keeps
    a connection to this answerer into the real server's time."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(LOADING_BODY)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": LOADING_BODY})


class LoadingAnswers:
    """While the model loads: every request on ``sock`` is answered 503 "Loading model", as
    llama-server answers every route (/health included) until its model is loaded.

    Why: the socket is bound before the load so that a taken port fails at once, and a bound
    socket that nobody accepts on leaves a client's connection hanging for the whole load (a
    health check with a timeout fails, a script polling /health waits without being told why).
    It runs uvicorn on a duplicate of the socket in a thread of its own; ``stop`` closes only
    the duplicate, so connections still waiting on the socket go to the real server."""

    def __init__(self, sock: socket.socket) -> None:
        config = uvicorn.Config(_loading_app, http="h11", loop="asyncio", lifespan="off", log_level="warning",
                                access_log=False, server_header=False, timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)  # in a thread: it installs no signal handler
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock.dup()]},
                                        name="saem-loading-answers", daemon=True)

    def start(self) -> LoadingAnswers:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering; a second call does nothing. The duplicate stops accepting first, and
        connections it accepted have ``STOP_GRACE_S`` to send their request and be answered:
        uvicorn's stop closes a connection whose request has not come yet, which would leave a
        client that connected just before the switch without an answer."""
        if not self._thread.is_alive():
            return
        # none where uvicorn has not started listening yet (a model that fails at once): then no
        # connection was accepted, and there is nothing to wait for
        listeners = list(getattr(self._server, "servers", ()))
        for listener in listeners:
            listener.get_loop().call_soon_threadsafe(listener.close)
        if listeners:
            time.sleep(STOP_GRACE_S)
        self._server.should_exit = True
        self._thread.join()


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the stop described in the module docstring."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.stopping = True
        cancel_later = asyncio.create_task(self._cancel_in_flight_after(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            cancel_later.cancel()

    async def _cancel_in_flight_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        busy = self.state.scheduler.stats().get("busy_slots", 0)
        print(f"[saem] shutdown: cancelling the requests still running after {seconds:g} s ({busy} decoding)",
              file=sys.stderr)
        await asyncio.to_thread(self.state.scheduler.stop, False)


def serve(app: ASGIApp, state: ServerState, sock: socket.socket, cfg: ListenConfig) -> None:
    """Serve ``app`` until a stop signal; the scheduler is stopped (in-flight requests cancelled) on
    the way out."""
    config = uvicorn.Config(app, http="h11", loop="asyncio", lifespan="off",
                            log_level="info" if cfg.verbose else "warning", access_log=cfg.verbose,
                            server_header=False,
                            # a backstop only: the scheduler's cancel above answers every request first
                            timeout_graceful_shutdown=cfg.shutdown_timeout + 5)
    server = GracefulServer(config, state, cfg.shutdown_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        state.scheduler.stop(False)
