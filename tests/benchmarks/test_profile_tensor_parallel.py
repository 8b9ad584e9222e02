"""benchmarks/profile_tensor_parallel.py runs on GPUs only; here, on the CPU: its reading of a rank's trace (the
busy chain by part, the idle gaps, the window of a worker's last steps) on traces made up for the purpose, and
that what it swaps and names in the engine still exists, so a rename breaks this test rather than a GPU run."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("benchmarks_on_path")

# (start us, end us, name), two steps: a product overlapping the norm before it (PDL), an all-reduce after an idle
# gap of 2 us, then attention.
TWO_STEPS = [
    (0.0, 1.0, "ncclDevKernel_Broadcast_RING_LL"),
    (1.0, 3.0, "_rms_norm_kernel"),
    (2.5, 10.0, "_skinny_kernel"),
    (12.0, 20.0, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
    (20.0, 24.0, "decode_tile_attention_kernel"),
    (24.0, 25.0, "some_new_kernel"),
    (25.0, 26.0, "ncclDevKernel_Broadcast_RING_LL"),
    (26.0, 28.0, "_rms_norm_kernel"),
    (27.5, 35.0, "_skinny_kernel"),
    (37.0, 45.0, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
    (45.0, 49.0, "decode_tile_attention_kernel"),
    (49.0, 50.0, "some_new_kernel"),
]


def test_the_busy_chain_charges_overlaps_once_and_adds_up_to_the_busy_time():
    from profile_tensor_parallel import OTHER, busy_chain, timeline

    chain, others = busy_chain(TWO_STEPS, steps=2)
    assert chain["products"] == pytest.approx(7.0 / 1e3)   # 2.5-10 less the norm's 0.5 us before 3.0
    assert chain["RMSNorm"] == pytest.approx(2.0 / 1e3)
    assert chain["all-reduces"] == pytest.approx(8.0 / 1e3)
    assert chain["tree attention"] == pytest.approx(4.0 / 1e3)
    assert chain["token broadcast"] == pytest.approx(1.0 / 1e3)
    assert chain[OTHER] == pytest.approx(1.0 / 1e3) and others == {"some_new_kernel": pytest.approx(1.0 / 1e3)}
    figures, lines = timeline(TWO_STEPS, steps=2)
    assert sum(chain.values()) == pytest.approx(figures["busy_ms"])
    assert figures["span_ms"] == pytest.approx(25.0 / 1e3)
    assert figures["idle_ms"] == pytest.approx(2.0 / 1e3) and figures["gaps"] == 1
    assert lines == ["    2.0 us a step idle after products before all-reduces"]


def test_a_workers_window_starts_at_its_last_steps_broadcasts(tmp_path):
    from profile_tensor_parallel import last_steps

    events = [{"cat": "kernel", "ts": start, "dur": stop - start, "name": name} for start, stop, name in TWO_STEPS]
    events.append({"cat": "cpu_op", "ts": 0.0, "dur": 50.0, "name": "aten::mm"})   # not the GPU's
    trace = tmp_path / "rank1.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert last_steps(trace, 1, whole=False) == TWO_STEPS[6:]
    assert last_steps(trace, 2, whole=True) == TWO_STEPS
    with pytest.raises(RuntimeError, match="2 token broadcasts, fewer than the 3 steps"):
        last_steps(trace, 3, whole=False)
    with pytest.raises(RuntimeError, match="did not write its trace"):
        last_steps(tmp_path / "rank2.json", 1, whole=False)


def test_it_refuses_the_cpu_and_what_it_swaps_in_the_engine_exists():
    import profile_tensor_parallel

    from dendrite_nb.distributed import group, worker

    with pytest.raises(SystemExit, match="GPUs"):
        profile_tensor_parallel.main(["--smoke", "--device", "cpu"])
    assert callable(worker.serve) and callable(worker.Worker.run)
    assert group.worker is worker   # the group spawns worker.serve, looked up when it starts a worker
