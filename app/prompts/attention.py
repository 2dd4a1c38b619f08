"""A1111's emphasis syntax: a prompt -> [(text, weight)], with `BREAK` markers, in one linear scan.

The rules (A1111's `parse_prompt_attention`, as its docstring documents them):

* `(text)` multiplies the weight of `text` by 1.1, `[text]` by 1/1.1, `(text:1.3)` by 1.3; they nest
  and multiply; a bracket never closed applies to the end of the prompt; a `)` or `]` with nothing
  open, and `:1.3)` with no `(` open, are plain text;
* `\\(`, `\\)`, `\\[`, `\\]`, `\\\\` are the literal characters; a backslash before anything else is dropped;
* `BREAK` (upper case, a word of its own) ends the current chunk: it comes out as ("BREAK", -1.0),
  and the whitespace around it is dropped. It is only recognised in plain text at weight 1: inside
  brackets its weight is multiplied too, and then (as in A1111) it is the word "BREAK";
* neighbouring parts of equal weight are merged; an empty prompt is [("", 1.0)].

Weights are multiplied in the order A1111 multiplies them (each bracket's multiplier at the moment it
closes, unclosed ones at the end: round first, then square), so they are the same floats:
`((house:1.3))` is 1.3 × 1.1 × 1.1 = 1.5730000000000004, as A1111's doctest shows.

Why a hand-written scanner: the text is user input (and from a share link, anyone's); one pass over
the characters with no backtracking costs O(length). The weights are applied as one vectorised
multiply per bracket over the runs of text between brackets (a few milliseconds at the
16,000-character prompt cap, however the brackets nest).
"""

from __future__ import annotations

import torch

ROUND, SQUARE = 1.1, 1 / 1.1
BREAK = "BREAK"
BREAK_WEIGHT = -1.0
_SPECIAL = frozenset("\\()[]:")
_ESCAPABLE = frozenset("()[]\\")


def is_break(text: str, weight: float) -> bool:
    """Is this parsed part a chunk break (A1111 compares both, so a bracketed BREAK is a word)?"""
    return text == BREAK and weight == BREAK_WEIGHT


def _word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"  # what `\b` in a Python str regex calls a word character


def split_breaks(run: str) -> list[str]:
    """`run` split at each `BREAK` with word boundaries, eating the whitespace around it (A1111's
    `\\s*\\bBREAK\\b\\s*`); [run] when it has none."""
    parts, start, i, n = [], 0, 0, len(run)
    while True:
        i = run.find(BREAK, i)
        if i < 0:
            break
        end = i + len(BREAK)
        if (i > 0 and _word(run[i - 1])) or (end < n and _word(run[end])):
            i += 1
            continue
        left = i
        while left > start and run[left - 1].isspace():
            left -= 1
        while end < n and run[end].isspace():
            end += 1
        parts.append(run[start:left])
        start = i = end
    parts.append(run[start:])
    return parts


def _weight_close(text: str, i: int) -> tuple[str, int] | None:
    """At a `:`, A1111's `:([+-]?[.\\d]+)\\)`: (the number's text, index after the `)`), else None."""
    j = i + 1
    if j < len(text) and text[j] in "+-":
        j += 1
    digits = j
    while j < len(text) and (text[j] == "." or text[j].isdecimal()):
        j += 1
    if j == digits or j >= len(text) or text[j] != ")":
        return None
    return text[i + 1:j], j + 1


class _Parts:
    """The parts found so far, grouped in runs: parts appended with no bracket opened or closed in
    between share every later multiplier, so a bracket multiplies runs, not parts."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, str]] = []  # (run index, text)
        self.runs = 0
        self.fresh = True  # the next part starts a new run
        self.events: list[tuple[int, int, float]] = []  # (first run, end run, multiplier), in order

    def add(self, text: str) -> None:
        if self.fresh:
            self.runs += 1
            self.fresh = False
        self.parts.append((self.runs - 1, text))

    def add_text(self, text: str) -> None:
        """Plain text, split at `BREAK`s (markers get a run of their own, weight -1)."""
        for k, piece in enumerate(split_breaks(text)):
            if k:
                self.fresh = True
                self.add(BREAK)
                self.events.append((self.runs - 1, self.runs, -1.0))
                self.fresh = True
            self.add(piece)

    def mark(self) -> int:
        """A bracket opens: later parts start a new run; returns the run it starts at."""
        self.fresh = True
        return self.runs

    def multiply(self, start: int, multiplier: float) -> None:
        self.events.append((start, self.runs, multiplier))
        self.fresh = True

    def weighted(self) -> list[tuple[str, float]]:
        weights = torch.ones(self.runs, dtype=torch.float64)
        for start, end, multiplier in self.events:
            weights[start:end] *= multiplier
        values = weights.tolist()
        return [(text, values[run]) for run, text in self.parts]


def _scan(text: str) -> _Parts:
    """One pass over the characters, as A1111's tokenizer regex splits them (see the module docstring)."""
    found, rounds, squares = _Parts(), [], []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            escaped = i + 1 < n and text[i + 1] in _ESCAPABLE
            found.add(text[i + 1] if escaped else "")
            i += 2 if escaped else 1
        elif ch == "(":
            rounds.append(found.mark())
            i += 1
        elif ch == "[":
            squares.append(found.mark())
            i += 1
        elif ch == ":" and rounds and (close := _weight_close(text, i)) is not None:
            number, i = close
            try:
                multiplier = float(number)
            except ValueError:
                raise ValueError(f"prompt: {text[max(0, i - 20):i]!r} — {number!r} is not a number "
                                 "(write (text:1.2), or \\: for a literal colon)") from None
            found.multiply(rounds.pop(), multiplier)
        elif ch == ")" and rounds:
            found.multiply(rounds.pop(), ROUND)
            i += 1
        elif ch == "]" and squares:
            found.multiply(squares.pop(), SQUARE)
            i += 1
        else:
            j = i + 1
            if ch not in _SPECIAL:
                while j < n and text[j] not in _SPECIAL:
                    j += 1
            elif ch == ":" and (close := _weight_close(text, i)) is not None:
                j = close[1]  # `:1.3)` with no `(` open is text, all of it (A1111's regex takes it whole)
            found.add_text(text[i:j])
            i = j
    for start in rounds:
        found.multiply(start, ROUND)
    for start in squares:
        found.multiply(start, SQUARE)
    return found


def parse_attention(text: str) -> list[tuple[str, float]]:
    """A1111's parts of `text`: [(text, weight)] with ("BREAK", -1.0) markers; see the module docstring."""
    parts = _scan(text).weighted() or [("", 1.0)]
    merged = [parts[0]]
    for part in parts[1:]:
        if part[1] == merged[-1][1]:
            merged[-1] = (merged[-1][0] + part[0], part[1])
        else:
            merged.append(part)
    return merged
