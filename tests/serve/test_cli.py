"""`python -m dendrite_nb serve`: it serves, and Ctrl-C shuts it down cleanly, ending the streams in flight."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.timeout(300)
def test_serve_answers_and_ctrl_c_stops_it_cleanly(real_gguf):
    port = free_port()
    # A new session: the SIGINT below reaches the server alone, and Python's own SIGINT handler is installed
    # whatever this test process inherited.
    server = subprocess.Popen([sys.executable, "-m", "dendrite_nb", "serve", str(real_gguf), "--port", str(port),
                               "--num-blocks", "256"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{base}/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        reply = httpx.post(f"{base}/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 3,
                                                        "temperature": 0}, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        events = []

        def stream():
            body = {"model": "m", "prompt": "Count: one, two,", "max_tokens": 2000, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{base}/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    events.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        while not any(line.startswith("data: ") for line in events):
            time.sleep(0.1)
        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 0
        assert "dendrite-nb serve: stopped" in server.stdout.read()
        reader.join(60)
        assert not reader.is_alive()
        assert "shutting down" in "\n".join(events)   # the stream ended with the server's error event
    finally:
        if server.poll() is None:
            server.kill()
