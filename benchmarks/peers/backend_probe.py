"""Whether llama.cpp's backend sampler (greedy in the decode's own graph; experimental in llama.cpp) works with this
build and GGUF, tried in a child process so that a crash of it ends the child, not the benchmark that asks.

The child greedily decodes two forks of one prompt twice, choosing tokens on the host and by the backend sampler,
and prints both as one JSON line; the sampler is usable when the child ends well and the two agree.

    backend_sampling_works(gguf, n_gpu_layers) -> (usable, what was seen)
    python -m peers.backend_probe GGUF N_GPU_LAYERS        (from benchmarks/) the child's side
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE_TOKENS = 8
PROBE_TIMEOUT_S = 300


def backend_sampling_works(gguf: Path, n_gpu_layers: int) -> tuple[bool, str]:
    command = [sys.executable, "-m", "peers.backend_probe", str(gguf), str(n_gpu_layers)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False,
                              cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        return False, f"the probe ran past {PROBE_TIMEOUT_S} s"
    if done.returncode != 0:
        return False, f"the probe ended with code {done.returncode}: {done.stderr.strip()[-300:]}"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if found["backend"] != found["host"]:
        return False, f"its greedy tokens {found['backend']} differ from the host's {found['host']}"
    return True, f"its greedy tokens equal the host's ({PROBE_TOKENS} tokens on 2 forks)"


def probe(gguf: Path, n_gpu_layers: int) -> dict[str, list[list[int]]]:
    from .llama_cpp_peer import LlamaCppModel, LlamaCppPeer, LlamaSetting

    model = LlamaCppModel(gguf, n_gpu_layers)
    prompt = list(range(3, 35))
    found = {}
    for backend in (False, True):
        peer = LlamaCppPeer(model, LlamaSetting(1, True, "f16", backend), n_ctx=256, n_seq_max=4)
        root = peer.new_sequence()
        peer.feed([(root, prompt)])
        found["backend" if backend else "host"] = peer.generate(peer.fork(root, 2), PROBE_TOKENS)
        peer.close()
    return found


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1]), int(sys.argv[2]))))
