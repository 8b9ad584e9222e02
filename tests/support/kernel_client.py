"""Driving a real Jupyter kernel over ZeroMQ as JupyterLab does (jupyter_client): execute_requests that carry
cell metadata, their output collected from the iopub channel."""
import queue
import time
from contextlib import contextmanager

TIMEOUT_S = 60


@contextmanager
def running_kernel():
    """A fresh python3 kernel and a client with its channels open: (manager, client); shut down at the end."""
    import jupyter_client

    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=TIMEOUT_S)
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def execute(client, code, metadata=None, on_first_display=None):
    """Send one execute_request (with JupyterLab-style cell metadata) and collect its iopub output."""
    content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
               "allow_stdin": False, "stop_on_error": True}
    message = client.session.msg("execute_request", content, metadata=metadata or {})
    client.shell_channel.send(message)
    msg_id = message["header"]["msg_id"]
    outputs, shown = [], False
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            msg = client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "status" and msg["content"]["execution_state"] == "idle":
            break
        if kind in ("stream", "display_data", "execute_result", "error", "update_display_data"):
            outputs.append((kind, msg["content"]))
        if kind == "display_data" and on_first_display and not shown:
            shown = True
            on_first_display()
    # wait_for_ready leaves its own kernel_info_reply on the shell channel when the kernel answered the probe
    # more than once (a slow start): skip replies to other requests instead of taking one as this cell's.
    reply = client.get_shell_msg(timeout=TIMEOUT_S)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = client.get_shell_msg(timeout=TIMEOUT_S)
    return reply["content"], outputs


def text_of(outputs):
    parts = []
    for kind, content in outputs:
        if kind == "stream":
            parts.append(content["text"])
        elif kind in ("display_data", "execute_result", "update_display_data"):
            parts.append(content["data"].get("text/plain", ""))
        elif kind == "error":
            parts.append(f"{content['ename']}: {content['evalue']}")
    return "\n".join(parts)
