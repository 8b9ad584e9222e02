"""Timing on a shared machine: how much CPU the rest of the machine took while a run was timed, and waiting for a
quiet moment before a run is timed again.

On the 2-core CI machine other jobs come and go; a two-thread run that shares its cores slows by 5-20x (both
torch's and llama.cpp's threads wait on each other at every barrier). `Others` reads /proc/stat (every process's
CPU time, and the time the hypervisor took: steal) and /proc/self/stat (this process's) and gives the cores the rest
used over an interval. A timed run (of at least half a second: /proc counts in 10 ms ticks) during which others used
more than `busy_cores` is redone after the machine has been quiet for a moment, at most `attempts` times; the figure
kept is the least disturbed attempt's. Where /proc is
missing (not Linux), runs are timed once, unguarded.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, TypeVar

T = TypeVar("T")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Sample(NamedTuple):
    wall: float
    others_s: float  # CPU seconds of every other process plus steal, since boot


def sample() -> Sample | None:
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        with open("/proc/self/stat") as own:
            parts = own.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    mine = int(parts[11]) + int(parts[12])   # utime + stime of all this process's threads
    return Sample(time.perf_counter(), (user + nice + system + irq + softirq + steal - mine) / _TICKS_PER_S)


def cores_used(start: Sample, end: Sample) -> float:
    """Cores the rest of the machine used between two samples (0: it was idle)."""
    return max(end.others_s - start.others_s, 0.0) / max(end.wall - start.wall, 1e-9)


@dataclass
class Guard:
    busy_cores: float = 0.25  # others' average use above which a timed run counts as disturbed
    attempts: int = 3  # timed runs at most, per figure
    quiet_cores: float = 0.1  # what counts as quiet while waiting
    quiet_s: float = 2.0  # how long it must stay quiet
    max_wait_s: float = 120.0  # then the run goes ahead anyway
    min_judged_s: float = 0.5  # shorter runs are kept as they are: /proc counts CPU time in ticks of 10 ms
    disturbed: int = 0  # runs redone so far
    kept_disturbed: int = 0  # figures kept although every attempt was disturbed

    def wait_for_quiet(self) -> None:
        deadline = time.perf_counter() + self.max_wait_s
        while time.perf_counter() < deadline:
            start = sample()
            if start is None:
                return
            time.sleep(self.quiet_s)
            if cores_used(start, sample()) <= self.quiet_cores:
                return

    def run(self, fn: Callable[[], T], log: Callable[[str], None]) -> tuple[T, float]:
        """fn's result from its least disturbed attempt, and the cores others used during that attempt."""
        best: tuple[T, float] | None = None
        for attempt in range(self.attempts):
            start = sample()
            result = fn()
            end = sample() if start is not None else None
            used = cores_used(start, end) if end is not None else 0.0
            if best is None or used < best[1]:
                best = (result, used)
            if used <= self.busy_cores or end is None or end.wall - start.wall < self.min_judged_s:
                return best
            self.disturbed += 1
            if attempt + 1 < self.attempts:
                log(f"      (others used {used:.2f} cores during that run: waiting for a quiet moment, then again)")
                self.wait_for_quiet()
        self.kept_disturbed += 1
        return best
