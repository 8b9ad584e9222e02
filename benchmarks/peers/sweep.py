"""Running one workload on every variant of every system, and picking each system's best.

A Variant is a system at one setting (the engine at a dtype and weight format; llama.cpp at a weight file and a
LlamaSetting). `open(workload)` gives a System ready for that workload: the engine, reset; llama.cpp, a fresh context
sized for it. Every open is followed by an untimed warm-up and `prepare`, then timed runs.

Stage 1, the sweep: each variant runs the workload once. llama.cpp's settings are searched coordinate-wise (unless
full_grid): every weight file at the reference setting (the first value of each knob); then, on the fastest file,
each knob changed alone; then, if two or more changes helped, all the helping changes together. Stage 2: the
fastest variant of each system (by the workload's first metric) runs `repeats - 1` more times, the two systems
alternating, one run at a time; each figure is the median of the variant's `repeats` runs (its sweep run included).
Every timed run is guarded against other load on the machine (quiet.py): redone, after a quiet moment, while the rest
of the machine used more than a quarter of a core during it.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .llama_types import LlamaCppError, LlamaSetting
from .quiet import Guard
from .workloads import Texts, Workload

if TYPE_CHECKING:   # annotations only: llama_worker.py imports this module in a process without torch
    from .systems import System


@dataclass(eq=False)
class Variant:
    system: str  # "engine" or "llama.cpp"
    setting: str  # what the report names, e.g. "float32" or "q4_1, 2 threads, FA off, KV f16"
    weight_bytes: float  # read by one decode step (layers, final norm, LM head): the decode floor's bytes
    open: Callable[[Workload], System] | None  # None: `session` makes the variant's sessions
    close_after: bool  # llama.cpp contexts are made per workload and closed after it; the engine stays
    # A session that runs elsewhere (llama_worker.RemoteSession: another process), with Session's run and close.
    session: Callable[[Workload, Texts], Any] | None = None


@dataclass
class Trial:
    variant: Variant
    runs: list[dict[str, float]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # generated in the first run
    unavailable: str | None = None  # why the variant could not run here (llama.cpp refused its context)

    def median(self, key: str) -> float:
        return statistics.median(run[key] for run in self.runs)


@dataclass
class Outcome:
    workload: Workload
    trials: list[Trial]  # in the order run
    best: dict[str, Trial]  # system -> its fastest variant
    load: tuple[float, float]  # 1-minute load average before and after


WARM_UP_SEQUENCES, WARM_UP_CELLS = 5, 256  # what warm_up needs of a llama.cpp context


def first_run(trial: Trial, key: str) -> float:
    """The trial's sweep figure; an unavailable variant never wins."""
    return trial.runs[0][key] if trial.runs else float("inf")


def open_session(variant: Variant, workload: Workload, texts: Texts) -> Any:
    """The variant's own kind of session (Variant.session), or a Session in this process."""
    return variant.session(workload, texts) if variant.session is not None else Session(variant, workload, texts)


def warm_run(system: System, workload: Workload) -> System:
    """`system` after one untimed run of the whole workload (a GPU's graph captures and allocations for its shapes)."""
    state = workload.prepare(system)
    workload.run(system, state)
    system.reset()
    return system


def warm_up(system: System, texts: Texts) -> None:
    """Untimed: a short prompt, forks, an extend and a few steps, so no timed run pays a first call's costs."""
    root = system.root(texts.document[:32])
    kids = system.fork(root, WARM_UP_SEQUENCES - 1)
    system.extend([(kid, texts.instructions[i]) for i, kid in enumerate(kids)])
    system.generate(kids, 3)
    system.prune([root, *kids])


class Session:
    """One open system of one variant, prepared for one workload."""

    def __init__(self, variant: Variant, workload: Workload, texts: Texts):
        self.variant, self.workload = variant, workload
        self.system = variant.open(workload)
        warm_up(self.system, texts)
        self.state = workload.prepare(self.system)

    def run(self, guard: Guard, log: Callable[[str], None]) -> tuple[dict[str, float], list[int]]:
        """One timed run, redone while others' load disturbs it (quiet.Guard); figures["others_cores"] says how
        many cores the rest of the machine used during the run kept."""
        (figures, tokens), others = guard.run(lambda: self.workload.run(self.system, self.state), log)
        return {**figures, "others_cores": others}, tokens

    def close(self) -> None:
        self.system.reset()
        if self.variant.close_after:
            self.system.close()


def run_once(trial: Trial, workload: Workload, texts: Texts, guard: Guard, log: Callable[[str], None]) -> None:
    try:
        session = open_session(trial.variant, workload, texts)
    except LlamaCppError as error:   # e.g. a quantized V cache without flash attention
        trial.unavailable = str(error)
        log(f"    {trial.variant.system} {trial.variant.setting}: unavailable: {error}")
        return
    try:
        figures, tokens = session.run(guard, log)
    finally:
        session.close()
    trial.runs.append(figures)
    trial.tokens = tokens
    key = workload.metrics[0].key
    log(f"    {trial.variant.system} {trial.variant.setting}: {figures[key]:.4g} s")


def llama_search(workload: Workload, texts: Texts, files: list[str], knobs: dict[str, list[Any]],
                 variant: Callable[[str, LlamaSetting], Variant], full_grid: bool, guard: Guard,
                 log: Callable[[str], None]) -> list[Trial]:
    """The llama.cpp trials of stage 1 (see the module docstring). knobs: threads, flash_attn, kv_type values."""
    key = workload.metrics[0].key
    trials: dict[tuple[str, LlamaSetting], Trial] = {}

    def trial(file: str, setting: LlamaSetting) -> Trial:
        if (file, setting) not in trials:
            trials[(file, setting)] = Trial(variant(file, setting))
            run_once(trials[(file, setting)], workload, texts, guard, log)
        return trials[(file, setting)]

    reference = LlamaSetting(**{name: values[0] for name, values in knobs.items()})
    if full_grid or not workload.sweep:
        files = files if workload.sweep else files[:1]
        combos = itertools.product(*knobs.values()) if workload.sweep else [tuple(v[0] for v in knobs.values())]
        for file, values in itertools.product(files, list(combos)):
            trial(file, LlamaSetting(**dict(zip(knobs, values))))
        return list(trials.values())
    base = min((trial(file, reference) for file in files), key=lambda t: first_run(t, key))
    file = next(f for (f, s), t in trials.items() if t is base)
    helping: dict[str, Any] = {}  # knob -> its value that beat the reference by the most
    for name, values in knobs.items():
        tried = [(first_run(trial(file, dataclasses.replace(reference, **{name: value})), key), value)
                 for value in values[1:]]
        better = [(seconds, value) for seconds, value in tried if seconds < first_run(base, key)]
        if better:
            helping[name] = min(better)[1]
    if len(helping) >= 2:
        trial(file, dataclasses.replace(reference, **helping))
    return list(trials.values())


def run_workload(workload: Workload, texts: Texts, engines: list[Variant], files: list[str],
                 knobs: dict[str, list[Any]], llama_variant: Callable[[str, LlamaSetting], Variant],
                 repeats: int, full_grid: bool, guard: Guard, log: Callable[[str], None]) -> Outcome:
    load_before = os.getloadavg()[0]
    key = workload.metrics[0].key
    log(f"\n{workload.name}")
    engine_trials = [Trial(v) for v in (engines if workload.sweep else engines[:1])]
    for trial in engine_trials:
        run_once(trial, workload, texts, guard, log)
    llama_trials = llama_search(workload, texts, files, knobs, llama_variant, full_grid, guard, log)
    best = {"engine": min(engine_trials, key=lambda t: first_run(t, key)),
            "llama.cpp": min(llama_trials, key=lambda t: first_run(t, key))}
    if not best["llama.cpp"].runs:
        raise SystemExit(f"{workload.name}: no llama.cpp variant could run: {best['llama.cpp'].unavailable}")
    if repeats > 1:
        log(f"  best: engine {best['engine'].variant.setting}; llama.cpp {best['llama.cpp'].variant.setting}; "
            f"{repeats - 1} more runs each, alternating")
        sessions = [open_session(t.variant, workload, texts) for t in best.values()]
        try:
            for _ in range(repeats - 1):
                for trial, session in zip(best.values(), sessions):
                    figures, _ = session.run(guard, log)
                    trial.runs.append(figures)
        finally:
            for session in sessions:
                session.close()
    return Outcome(workload, engine_trials + llama_trials, best, (load_before, os.getloadavg()[0]))
