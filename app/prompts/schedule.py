"""A1111's prompt editing and alternation: which text a prompt is at each step of a pass.

The syntax (A1111's wiki, "Prompt editing" and "Alternating words"):

* `[from:to:when]` reads `from` up to step `when`, then `to`; `[to:when]` adds `to` from then on,
  `[from::when]` removes `from` then. `when` with a decimal point is a fraction of the pass's steps,
  without one a step number. They nest, and sit inside emphasis: `([cat:dog:0.5]:1.2)`.
* `[a|b|c]` alternates: step 1 reads `a`, step 2 `b`, step 3 `c`, step 4 `a` …
* Anything else in brackets is emphasis (`app/prompts/attention.py`) and is kept as written, so each
  scheduled text is then read as any prompt is; a bracket that opens no valid construct is text.

The schedule is A1111's (`get_learned_conditioning_prompt_schedules`, its default "new" scheduling):
a list of `(end, text)` whose last `end` is the pass's steps, and the sampler's step `s` (counted from
0) reads the first entry with `s <= end`, so `[a:b:10]` over 20 steps reads `a` for steps 0-10.
In the hires pass a fraction counts from 1.0 (`[a:b:1.5]`: half-way through the hires pass) and a
step number from the end of the first pass, so a switch the first pass made holds in the second.
The reader backtracks only over a bracket that opens no valid construct (read again as text), and
both its work and its nesting are capped (`_WORK_PER_CHAR`, `_MAX_DEPTH`): a prompt past them (16,000
brackets that never close, from a share link) is read as written, unscheduled, as A1111 reads a
prompt its parser fails on, in time linear in its length.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

_NUMBER = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*")
_SYNTAX = frozenset("[]():|\\")
_MAX_DEPTH = 32  # brackets nested deeper are text
_WORK_PER_CHAR = 16  # reader steps per character of the prompt before it is read as written


class _TooComplex(Exception):
    """The prompt needs more reading than the cap allows; it is taken as written."""


@dataclass(frozen=True)
class _Scheduled:
    before: tuple
    after: tuple
    when: str  # as written: a decimal point makes it a fraction


@dataclass(frozen=True)
class _Alternate:
    options: tuple


class _Reader:
    """A recursive-descent reader of the grammar above over `text` (see `parse`)."""

    def __init__(self, text: str) -> None:
        self.text, self.pos, self.depth = text, 0, 0
        self.budget = _WORK_PER_CHAR * len(text) + 1000

    def sequence(self, stops: str) -> list:
        """Parts up to (not including) a character of `stops` or the end."""
        parts: list = []
        text = self.text
        while self.pos < len(text) and text[self.pos] not in stops:
            self.budget -= 1
            if self.budget < 0:
                raise _TooComplex
            ch = text[self.pos]
            if ch == "\\":
                parts.append(text[self.pos:self.pos + 2])
                self.pos += 2
            elif ch in "[(" and self.depth < _MAX_DEPTH:
                start = self.pos
                self.depth += 1
                construct = self._bracket() if ch == "[" else self._round()
                self.depth -= 1
                if construct is None:  # not a construct: its opening bracket is text
                    self.pos = start + 1
                    parts.append(ch)
                else:
                    parts.extend(construct)
            elif ch in _SYNTAX:  # a stray closing bracket, colon or bar at this level is text
                parts.append(ch)
                self.pos += 1
            else:
                end = self.pos
                while end < len(text) and text[end] not in _SYNTAX:
                    end += 1
                parts.append(text[self.pos:end])
                self.pos = end
        return parts

    def _expect(self, ch: str) -> bool:
        if self.pos < len(self.text) and self.text[self.pos] == ch:
            self.pos += 1
            return True
        return False

    def _round(self) -> list | None:
        """`(a)` or `(a:b)`: emphasis, kept as written with what it holds read for schedules."""
        self.pos += 1
        inner = self.sequence(":)")
        if self._expect(")"):
            return ["(", *inner, ")"]
        if self._expect(":"):
            weight = self.sequence(":)")
            if self._expect(")"):
                return ["(", *inner, ":", *weight, ")"]
        return None

    def _bracket(self) -> list | None:
        """`[a]` (emphasis), `[a|b…]`, `[to:when]`, `[from:to:when]`."""
        self.pos += 1
        first = self.sequence(":|]")
        if self._expect("]"):
            return ["[", *first, "]"]
        if self._expect("|"):
            options = [tuple(first)]
            while True:
                options.append(tuple(self.sequence("|]")))
                if self._expect("]"):
                    return [_Alternate(tuple(options))]
                if not self._expect("|"):
                    return None
        if not self._expect(":"):
            return None
        when = self._when()
        if when is not None:
            return [_Scheduled((), tuple(first), when)]
        second = self.sequence(":]")
        if not self._expect(":"):
            return None
        when = self._when()
        return None if when is None else [_Scheduled(tuple(first), tuple(second), when)]

    def _when(self) -> str | None:
        """A number, spaces around it allowed, closing the bracket: read past the `]`; else None, unmoved."""
        number = _NUMBER.match(self.text, self.pos)
        if number is None or not self.text.startswith("]", number.end()):
            return None
        self.pos = number.end() + 1
        return number.group(1)


def parse(text: str) -> tuple:
    """The prompt as a tree of text pieces, `_Scheduled` and `_Alternate` parts."""
    return tuple(_Reader(text).sequence(""))


def _step_of(when: str, steps: int, first_pass_steps: int | None) -> int:
    """A1111's switch step: a fraction of this pass (from 1.0 in the hires pass) or a step number (counted
    from the end of the first pass in the hires pass), at most `steps`."""
    value = float(when)
    if "." in when:
        value = (value - (1.0 if first_pass_steps is not None else 0.0)) * steps
    else:
        value -= first_pass_steps or 0
    return min(steps, int(value))


def _text_at(parts: tuple, step: int, steps: int, first_pass_steps: int | None) -> str:
    out = []
    for part in parts:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, _Scheduled):
            chosen = part.before if step <= _step_of(part.when, steps, first_pass_steps) else part.after
            out.append(_text_at(chosen, step, steps, first_pass_steps))
        else:
            out.append(_text_at(part.options[(step - 1) % len(part.options)], step, steps, first_pass_steps))
    return "".join(out)


def _ends(parts: tuple, steps: int, first_pass_steps: int | None, into: set[int]) -> None:
    for part in parts:
        if isinstance(part, _Scheduled):
            end = _step_of(part.when, steps, first_pass_steps)
            if end >= 1:
                into.add(end)
            _ends(part.before, steps, first_pass_steps, into)
            _ends(part.after, steps, first_pass_steps, into)
        elif isinstance(part, _Alternate):
            into.update(range(1, steps + 1))
            for option in part.options:
                _ends(option, steps, first_pass_steps, into)


def schedule(text: str, steps: int, first_pass_steps: int | None = None) -> list[tuple[int, str]]:
    """`[(end, text)]` for a pass of `steps` (see the module docstring); neighbours reading the same
    text are merged. `first_pass_steps`: this is a hires pass after a first pass of that many steps."""
    if "[" not in text:
        return [(steps, text)]
    try:
        parts = parse(text)
    except _TooComplex:
        return [(steps, text)]
    if all(isinstance(part, str) for part in parts):
        return [(steps, text)]
    ends: set[int] = {steps}
    _ends(parts, steps, first_pass_steps, ends)
    return merged_runs(ends, lambda end: _text_at(parts, end, steps, first_pass_steps))


def merged_runs(ends: Iterable[int], value_at: Callable[[int], T]) -> list[tuple[int, T]]:
    """`[(end, value_at(end))]` over the sorted `ends`, neighbours with equal values merged into the
    later end: a schedule lists only the steps where what is read changes."""
    runs: list[tuple[int, T]] = []
    for end in sorted(ends):
        value = value_at(end)
        if runs and runs[-1][1] == value:
            runs[-1] = (end, value)
        else:
            runs.append((end, value))
    return runs


def index_at(entries: Sequence[tuple[Any, ...]], step: int) -> int:
    """The entry (`(end, …)`) the sampler's step `step` (from 0) reads: the first with `step <= end`."""
    return next((i for i, entry in enumerate(entries) if step <= entry[0]), len(entries) - 1)


def text_at(entries: list[tuple[int, str]], step: int) -> str:
    """The text the sampler's step `step` (from 0) reads."""
    return entries[index_at(entries, step)][1]
