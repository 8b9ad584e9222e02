"""The kernel's OpenAI-compatible server (`%dendrite serve`): dendrite_nb.serve's Server over the session's engine.

The notebook and the server share the engine: the server's responses are branches of the notebook's tree, and the
server's engine thread decodes the notebook's `%gen` in its batch (server_gen.py). Starting the server turns the
engine's prefix cache on (the server keeps what pruned responses held, for later prompts to reuse); stopping it
sets the cache back as it was. The session stops it before its engine is replaced, and when the kernel exits.
"""
from __future__ import annotations

from typing import Any

from dendrite_nb import DendriteError, Engine


class KernelServer:
    """A running Server and what starting it changed on the engine."""

    def __init__(self, engine: Engine, host: str, port: int, api_key: str | None):
        try:   # uvicorn and starlette load only when a notebook serves
            from dendrite_nb.serve.server import Server
        except ImportError as error:
            raise DendriteError(f"%dendrite serve needs the server's packages: pip install 'dendrite-nb[serve]' "
                                f"({error}).") from None
        self.engine = engine
        self._prefix_cache_before = engine.prefix_cache
        try:
            self.server = Server(engine, host=host, port=port, api_key=api_key).start()
        except BaseException:
            engine.prefix_cache = self._prefix_cache_before   # Server() turned it on before it failed to listen
            raise
        self.api_key_set = api_key is not None

    @property
    def running(self) -> bool:
        return self.server.running and self.server.scheduler.running

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def model_name(self) -> str:
        return self.server.state.model_name

    @property
    def scheduler(self) -> Any:
        """The server's engine thread (dendrite_nb.serve.scheduler.Scheduler): %gen submits its jobs there."""
        return self.server.scheduler

    @property
    def waiting(self) -> int:
        """Requests waiting for room in the KV pool."""
        return self.server.scheduler.waiting

    @property
    def responses_kept(self) -> int:
        """Finished responses the server keeps as branches."""
        return len(self.server.retention)

    def stop(self) -> None:
        """Stop listening, end the streams in flight and the engine thread; the engine's prefix cache goes back to
        its setting from before. The responses' branches stay in the tree."""
        self.server.stop()
        if not self.engine.closed:
            self.engine.prefix_cache = self._prefix_cache_before
