"""What the magics return: small objects with a readable repr in the terminal and in the notebook.

They hold names, counts and text, never the engine, so the Out history cannot keep a replaced
model's memory alive. `_` after a magic is one of these; loop over it in Python.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Iterator

from dendrite_nb.wording import counted

FORK_MARK = "⑂"       # marks a fork point in %show's plain-text output
NEWLINE_MARK = "⏎"    # shown in place of a newline where a branch's text must fit one line
LISTED = 20           # names a result's repr writes out before "and N more" (the object keeps them all)


def one_line(text: str, width: int | None = None) -> str:
    flat = text.replace("\n", NEWLINE_MARK)
    if width is not None and len(flat) > width:
        return "…" + flat[-(width - 1):]
    return flat


def listed(items: list[str], limit: int = LISTED) -> str:
    """The first `limit` items, comma-separated, then how many more there are (`%fork p --n 1000` returns 1,000)."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit:,} more" if len(items) > limit else "")


def table_html(header: list[str], rows: list[list[str]], caption: str = "") -> str:
    head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{cell}</td>" for cell in row) + "</tr>"
                   for row in rows)
    cap = f"<caption style='text-align:left'>{html.escape(caption)}</caption>" if caption else ""
    return f"<table class='dendrite'>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class PrettyByRepr:
    """IPython's pretty printer and the plain repr show the same text."""

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))


@dataclass(frozen=True, repr=False)
class Loaded(PrettyByRepr):
    engine: str          # the engine's repr when it was loaded
    source: str          # checkpoint folder or "demo: MODEL (PATH)"
    replaced: str | None  # the engine that was closed to make room, if any
    fallback: str | None = None  # why a stand-in was loaded instead of the model asked for (the demo's), if so
    ranks: str | None = None     # where a tensor-parallel engine's processes run (ranks_line); None at --tp 1

    def __repr__(self) -> str:
        before = f"{self.fallback}\n" if self.fallback else ""
        ranks = f"\n{self.ranks}" if self.ranks else ""
        note = f"\n(closed and freed the previous engine: {self.replaced})" if self.replaced else ""
        return f"{before}loaded {self.source}\n{self.engine}{ranks}{note}"


@dataclass(frozen=True, repr=False)
class Reused(PrettyByRepr):
    """%dendrite demo found its model already loaded: it kept the weights and pruned every branch."""

    engine: str           # the engine's repr after the prune
    source: str
    pruned: int           # branches pruned for the fresh start
    freed_blocks: int

    def __repr__(self) -> str:
        cleared = (f"pruned its {counted(self.pruned, 'branch')} (freed {counted(self.freed_blocks, 'KV block')}) "
                   f"for a fresh start" if self.pruned else "it has no branches yet")
        return (f"reused {self.source}, already loaded in this session: {cleared}; add --replace to load it "
                f"again\n{self.engine}")


@dataclass(frozen=True, repr=False)
class Saved(PrettyByRepr):
    path: str
    branches: int
    blocks: int  # KV blocks in use that were written
    size_mib: float

    def __repr__(self) -> str:
        return (f"saved {counted(self.branches, 'branch')} and {counted(self.blocks, 'KV block')} "
                f"to {self.path} ({self.size_mib:,.1f} MiB)")


@dataclass(frozen=True, repr=False)
class AutosaveSet(PrettyByRepr):
    path: str | None  # None: autosave is off
    every: int

    def __repr__(self) -> str:
        if self.path is None:
            return "autosave off"
        cells = "cell" if self.every == 1 else f"{self.every} cells"
        return f"autosave to {self.path} after every {cells} that generate{'s' if self.every == 1 else ''}"


@dataclass(frozen=True, repr=False)
class Serving(PrettyByRepr):
    """%dendrite serve: where the server listens, and how to call it."""
    url: str             # the base URL clients use (http://host:port/v1)
    model: str           # the name /v1/models lists
    api_key_set: bool    # whether requests must send the key
    replaced: str | None = None  # the URL of the server it stopped first (--replace), if any

    def __repr__(self) -> str:
        key = "YOUR_KEY" if self.api_key_set else "unused"
        before = f"stopped the server at {self.replaced}\n" if self.replaced else ""
        return (f"{before}serving this session's engine at {self.url} (the OpenAI API: /models, /completions, "
                f"/chat/completions, /responses)\n"
                f"  from openai import OpenAI\n"
                f"  client = OpenAI(base_url={self.url!r}, api_key={key!r})\n"
                f"  client.chat.completions.create(model={self.model!r}, "
                f"messages=[{{'role': 'user', 'content': 'Hi!'}}])\n"
                f"Each response is a branch named after its id: %tree shows it, %fork, %show, %gen and %prune take "
                f"it; %gen joins the server's batch. Stop it with %dendrite serve stop.")


@dataclass(frozen=True, repr=False)
class ServerStopped(PrettyByRepr):
    url: str | None        # the server that was stopped; None when none ran
    responses_kept: int    # responses it kept, whose branches stay in the tree

    def __repr__(self) -> str:
        if self.url is None:
            return "no server was running"
        kept = (f"; the branches of its {counted(self.responses_kept, 'kept response')} stay in the tree"
                if self.responses_kept else "")
        return f"stopped the server at {self.url}{kept}"


@dataclass(frozen=True, repr=False)
class Branches(PrettyByRepr):
    """Branches a magic created or extended; iterate for their names."""
    action: str
    names: tuple[str, ...]
    num_tokens: tuple[int, ...]
    free_blocks: int
    text_logprob: float | None = None  # %%branch --logprobs: the appended text's mean log-probability
    reused_tokens: int | None = None     # a re-run %%branch: tokens of its text the old text gave (no forward)
    prefilled_tokens: int | None = None  # ... and those prefilled, from the first changed one on

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        rows = listed([f"{name} ({counted(count, 'token')})" for name, count in zip(self.names, self.num_tokens)])
        score = f"; the text's mean logprob {self.text_logprob:.3f}" if self.text_logprob is not None else ""
        return f"{self.action}: {rows}; {counted(self.free_blocks, 'KV block')} free{score}"


@dataclass(frozen=True, repr=False)
class Generated(PrettyByRepr):
    """The text each branch gained in one %gen; `result["name"]` is a branch's new text."""
    names: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    steps: int
    max_steps: int
    seconds: float
    interrupted: bool = False
    constraint: str | None = None
    logprobs: tuple[tuple[float, ...], ...] | None = None  # each new token's, with %gen --logprobs
    note: str | None = None  # what the cell did before generating (a re-run %%branch: what it reused)

    def __getitem__(self, name: str) -> str:
        if name not in self.names:
            raise KeyError(f"{name!r} was not generated here; this result has {', '.join(self.names)}")
        return self.texts[self.names.index(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def items(self) -> Iterator[tuple[str, str]]:
        return iter(zip(self.names, self.texts))

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def mean_logprobs(self) -> dict[str, float]:
        """Each branch's mean log-probability over its new tokens (NaN for a branch that gained none)."""
        if self.logprobs is None:
            raise ValueError("this generation kept no log-probabilities; run %gen with --logprobs.")
        return {name: sum(kept) / len(kept) if kept else math.nan for name, kept in zip(self.names, self.logprobs)}

    def _status(self) -> str:
        state = (f"interrupted after {self.steps} of {self.max_steps} steps" if self.interrupted
                 else counted(self.steps, "step"))
        return f"{counted(len(self.names), 'branch')}, {counted(self.num_tokens, 'new token')}, {state}"

    def __repr__(self) -> str:
        width = max(len(n) for n in self.names)
        means = self.mean_logprobs() if self.logprobs is not None else None
        lines = [f"{name:>{width}} │ " + (f"{means[name]:12.3f} │ " if means else "") + one_line(text)
                 for name, text in self.items()]
        header = [f"{'':>{width}} │ mean logprob │ new text"] if means else []
        return "\n".join([*([self.note] if self.note else []), self._status(), *header, *lines])

    def _repr_html_(self) -> str:
        means = self.mean_logprobs() if self.logprobs is not None else None
        rows = [[f"<b>{html.escape(name)}</b>", str(len(tokens)), *([f"{means[name]:.3f}"] if means else []),
                 f"<span style='white-space:pre-wrap'>{html.escape(text)}</span>"]
                for name, text, tokens in zip(self.names, self.texts, self.tokens)]
        header = ["branch", "tokens", *(["mean log-prob"] if means else []), "new text"]
        return table_html(header, rows, f"{self.note}. {self._status()}" if self.note else self._status())


@dataclass(frozen=True, repr=False)
class Pruned(PrettyByRepr):
    names: tuple[str, ...]
    freed_blocks: int
    free_blocks: int

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __repr__(self) -> str:
        return (f"pruned {listed(list(self.names))}: freed {counted(self.freed_blocks, 'KV block')}; "
                f"{self.free_blocks:,} free")


@dataclass(frozen=True)
class Segment:
    node: int            # tree node id
    start: int           # token position of the segment's first token
    text: str
    forks_after: tuple[str, ...] = ()  # other branches that leave the path at the end of this segment


@dataclass(frozen=True, repr=False)
class Shown(PrettyByRepr):
    """A branch's text from the root, split where the tree forks (FORK_MARK in plain text)."""
    name: str
    segments: tuple[Segment, ...] = field(default=())

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    def __repr__(self) -> str:
        return FORK_MARK.join(segment.text for segment in self.segments)

    def _repr_html_(self) -> str:
        spans = []
        for index, segment in enumerate(self.segments):
            shade = "rgba(127,127,127,0.10)" if index % 2 else "rgba(127,127,127,0.22)"
            others = f"; other branches fork here: {', '.join(segment.forks_after)}" if segment.forks_after else ""
            title = html.escape(f"node {segment.node}, from token {segment.start}{others}", quote=True)
            spans.append(f"<span title='{title}' style='background:{shade};white-space:pre-wrap'>"
                         f"{html.escape(segment.text)}</span>")
            if index < len(self.segments) - 1:
                spans.append(f"<b title='fork point' style='color:#d62728'>{FORK_MARK}</b>")
        return (f"<div class='dendrite-show'><div><b>{html.escape(self.name)}</b> "
                f"({counted(len(self.segments), 'segment')}; "
                f"{FORK_MARK} marks a fork point)</div><div style='font-family:monospace'>{''.join(spans)}</div></div>")
