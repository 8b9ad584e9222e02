"""The rule NCCL sets when its graph mixing support is off (distributed/channels.py): no collective launched outside a
CUDA graph while a graph with the group's collectives may still run. On the CPU, with the device group and CUDA's
events and capture state stood in for: a collective outside a graph waits for the last graph launched, once, and
before it is launched; one inside a capture does not wait; a wait that fails launches nothing."""
import datetime

import pytest
import torch
import torch.distributed as dist

from dendrite_nb.distributed import channels as channels_module
from dendrite_nb.distributed.channels import Channels


class FakeEvent:
    def __init__(self):
        self.recorded, self.done = 0, False

    def record(self):
        self.recorded += 1

    def query(self):
        return self.done


class FakeWork:
    def wait(self):
        return True


class FakeNccl:
    """Stands for the NCCL group: notes each collective launched."""
    def __init__(self, log):
        self.log = log

    def allreduce(self, tensors):
        self.log.append("all-reduce")
        return FakeWork()

    def broadcast(self, tensors, options):
        self.log.append("broadcast")
        return FakeWork()


@pytest.fixture
def rig(monkeypatch):
    """(channels with a stand-in NCCL group, the log of waits and collectives, the capture switch)."""
    log, capturing = [], {"on": False}
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])

    def wait_for(event):
        log.append(("wait", event))
    channels = Channels(dist.HashStore(), 0, 1, torch.device("cpu"), wait_for=wait_for)
    channels.device = FakeNccl(log)
    yield channels, log, capturing
    channels.device = channels.host
    channels.shutdown()


def test_a_collective_outside_a_graph_first_waits_for_the_last_graph_launched(rig):
    channels, log, capturing = rig
    tensor = torch.zeros(4)
    channels.all_reduce(tensor)   # no graph launched yet: no wait
    assert log == ["all-reduce"] and not channels.graph_pending
    channels.graph_launched()
    channels.graph_launched()   # the second replay's event is the one waited for
    event = channels._graph_done
    assert channels.graph_pending and event.recorded == 1
    capturing["on"] = True   # a capture's collectives are part of the graph: no wait
    channels.all_reduce(tensor, 1)
    assert log[-1] == "all-reduce" and len(log) == 2 and channels.graph_pending
    capturing["on"] = False
    channels.broadcast(tensor)
    assert log[2:] == [("wait", event), "broadcast"] and not channels.graph_pending
    channels.all_reduce(tensor)   # waited once: the next one goes straight out
    assert log[4:] == ["all-reduce"]


def test_a_wait_that_fails_launches_nothing_and_keeps_the_graph_pending(rig):
    channels, log, _ = rig

    def failing(event):
        raise RuntimeError("a worker is gone")
    channels._wait_for = failing
    channels.graph_launched()
    with pytest.raises(RuntimeError, match="a worker is gone"):
        channels.all_reduce(torch.zeros(4))
    assert log == [] and channels.graph_pending


def test_the_default_wait_gives_up_after_the_collective_timeout(monkeypatch):
    monkeypatch.setattr(channels_module, "COLLECTIVE_TIMEOUT", datetime.timedelta(seconds=0.05))
    with pytest.raises(RuntimeError, match="did not finish within"):
        channels_module._wait_for_event(FakeEvent())   # never done
    finished = FakeEvent()
    finished.done = True
    channels_module._wait_for_event(finished)


def test_a_cpu_group_has_no_graphs_to_wait_for():
    channels = Channels(dist.HashStore(), 0, 1, torch.device("cpu"))
    try:
        channels.graph_launched()
        assert not channels.graph_pending
    finally:
        channels.shutdown()
