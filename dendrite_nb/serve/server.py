"""The OpenAI-compatible server over one engine: uvicorn serving app.py, with the scheduler's engine thread.

`Server(engine).start()` runs it in the background (a notebook's `%dendrite serve`: the notebook keeps using the
same engine, and sees the server's branches in its tree); `serve_forever()` runs it in the foreground
(`python -m dendrite_nb serve MODEL`), where Ctrl-C shuts it down cleanly. It binds to 127.0.0.1 unless told
otherwise. Prefix retention (Engine.prefix_cache) is turned on: pruned responses stay as cache until the pool
needs their blocks.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from ..errors import DendriteError
from .app import ServerState, make_app
from .retention import Retention
from .scheduler import Scheduler

DEFAULT_MAX_RESPONSES = 1024   # responses kept as live branches (least recently used let go first)
DEFAULT_MAX_WAITING = 256      # requests that may wait for room in the pool; past that, 429


class Server:
    def __init__(self, engine: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 model_name: str | None = None, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_waiting: int = DEFAULT_MAX_WAITING):
        """port 0 picks a free port (read it from `url` once started)."""
        for name, value in (("max_responses", max_responses), ("max_waiting", max_waiting)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an int from 0 to 65535, got {port!r}.")
        self.engine, self.host, self._port = engine, host, port
        engine.prefix_cache = True
        self.retention = Retention(engine, max_responses)
        self.scheduler = Scheduler(engine, max_waiting, on_pressure=self.retention.make_room)
        name = model_name or _model_name(engine)
        self.state = ServerState(engine, self.scheduler, self.retention, name, api_key)
        self.app = make_app(self.state)
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL clients use (http://host:port/v1)."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def port(self) -> int:
        """The port it listens on (the one the system picked, for port 0, once started)."""
        return self._port

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _server(self):
        import uvicorn

        scheduler = self.scheduler

        class StopsTheEngineThread(uvicorn.Server):
            """On Ctrl-C (or SIGTERM), the engine thread stops first: every stream in flight ends at once with an
            error event (the server is shutting down) instead of holding the shutdown until it times out."""

            def handle_exit(self, sig, frame) -> None:
                scheduler.stop(timeout_s=0)
                super().handle_exit(sig, frame)

        config = uvicorn.Config(self.app, host=self.host, port=self._port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=5)
        self._uvicorn = StopsTheEngineThread(config)
        return self._uvicorn

    def start(self, timeout_s: float = 30.0) -> Server:
        """Serve in a background thread; returns once the port is listening."""
        if self.running:
            raise DendriteError(f"this server is running already, at {self.url}.")
        server = self._server()
        self.scheduler.start()
        self._thread = threading.Thread(target=self._run_quietly, args=(server,), name="dendrite-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.scheduler.stop()
                raise DendriteError(f"the server could not listen on {self.host}:{self._port} (is the port taken? "
                                    f"pick another with --port).")
            time.sleep(0.02)
        self._port = server.servers[0].sockets[0].getsockname()[1]
        return self

    @staticmethod
    def _run_quietly(server) -> None:
        try:
            server.run()
        except SystemExit:   # uvicorn's answer to a port it cannot bind: start() reports it
            pass

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop listening, end the streams in flight, and stop the engine thread; the engine stays usable."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        self.scheduler.stop(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._thread = None

    def serve_forever(self) -> None:
        """Serve in the foreground until Ctrl-C (uvicorn turns it into a clean shutdown)."""
        server = self._server()
        self.scheduler.start()
        try:
            server.run()
        finally:
            self.scheduler.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (f"Server({self.url}, {state}, {len(self.retention)} responses kept, "
                f"{self.scheduler.waiting} waiting)")


def _model_name(engine: Any) -> str:
    """The name /v1/models lists: the checkpoint's file or folder name."""
    checkpoint = (engine.source or {}).get("checkpoint")
    if checkpoint:
        return Path(checkpoint).stem if Path(checkpoint).suffix == ".gguf" else Path(checkpoint).name
    return "dendrite-nb"
