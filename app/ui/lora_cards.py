"""LoRA cards: what a file says about itself (safetensors metadata) and what the engine says about it.

Metadata comes from the file header only (no tensor data is read), so listing a folder of large
LoRAs stays cheap and never touches the engine's LoRA cache, which belongs to the worker. Whether
a LoRA is applied, set aside or disabled is the engine's word (`Snapshot.lora_states`); a card
only draws it. For information (and the LoRA browser's "fits this model" filter) a card also
shows the engine's own match report from `inspect_lora`, cached per (model hash, file identity)
because that report only changes when either side changes.
"""

from __future__ import annotations

import dataclasses
import html
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from app.adapters.errors import AdapterError, AdapterFormatError
from app.adapters.matching import MatchReport
from app.engine.lora_counters import LoraCounters
from app.engine.snapshot import LoraState
from app.families import lora_arch_of
from app.safetensors_files import SafetensorsFileError, lora_short_hash, read_header

# Suffix -> algorithm name, checked in order (LoRA last: LoCon/DoRA files also carry lora_down).
_ALGO_MARKERS = (("hada_w1", "LoHa"), ("lokr_w", "LoKr"), ("oft_blocks", "OFT"), ("a1.weight", "GLoRA"),
                 ("dora_scale", "DoRA"), ("lora_mid", "LoCon (Tucker)"), ("lora_down", "LoRA"),
                 ("lora_A", "LoRA (PEFT)"), ("_lora.down", "LoRA (diffusers attention processors)"),
                 (".lora.down", "LoRA (diffusers)"), ("lora_linear_layer", "LoRA (diffusers)"), (".diff", "Full"),
                 ("on_input", "IA3"))


@dataclass(frozen=True)
class CardInfo:
    """What a LoRA card shows; every field may be unknown (None) for files without metadata."""

    name: str
    base_model: str | None
    trigger_words: tuple[str, ...]
    rank: int | None
    alpha: str | None
    algorithm: str
    short_hash: str | None  # None until hashed: the LoRA browser lists files without reading them whole
    size_bytes: int
    modified: float = 0.0


@dataclass(frozen=True)
class Fit:
    """What `inspect_lora` answered for one file on the loaded model: level "ok", "warn" (applies, but
    some tensors match nothing, or the check could not run) or "error" (the engine refuses it), with
    the report of an accepted file (`MatchReport`: layout, scale source, the first unmatched tensor
    names, the architecture it fits). Shown for information and used to filter the LoRA browser;
    what is applied is decided by the engine alone."""

    level: str
    message: str
    matched_layers: int = 0
    unmatched_keys: int = 0
    layout: str = ""
    scale_source: str = ""
    unmatched_examples: tuple[str, ...] = ()
    fits: str = ""

    @classmethod
    def from_report(cls, report: MatchReport) -> Fit:
        return cls("warn" if report.unmatched_keys else "ok", report.message, report.matched_layers,
                   report.unmatched_keys, report.layout, report.scale_source, report.unmatched_examples, report.fits)

    def report_line(self) -> str:
        """layout · scale source · what was left over, for an accepted file ("" otherwise)."""
        if not self.layout:
            return ""
        facts = [f"layout: {self.layout}", f"scale: {self.scale_source}"]
        if self.unmatched_keys:
            more = "…" if self.unmatched_keys > len(self.unmatched_examples) else ""
            names = ", ".join(f"`{html.escape(k)}`" for k in self.unmatched_examples)
            facts.append(f"{self.unmatched_keys} tensors unmatched: {names}{more}")
        return " · ".join(facts)


def _trigger_words(meta: dict[str, str]) -> tuple[str, ...]:
    """Trigger words as trainers record them: explicit phrase first, else the most frequent tags."""
    for key in ("modelspec.trigger_phrase", "ss_trigger_words", "trigger_words"):
        if meta.get(key):
            return tuple(w.strip() for w in meta[key].split(",") if w.strip())[:8]
    try:
        frequencies = json.loads(meta.get("ss_tag_frequency") or "{}")
    except json.JSONDecodeError:
        return ()
    totals: dict[str, int] = {}
    for tags in frequencies.values():
        for tag, count in tags.items():
            totals[tag.strip()] = totals.get(tag.strip(), 0) + int(count)
    return tuple(sorted(totals, key=totals.get, reverse=True)[:5])


def _algorithm(meta: dict[str, str], keys: list[str]) -> str:
    try:
        args = json.loads(meta.get("ss_network_args") or "{}")
    except json.JSONDecodeError:
        args = {}
    if isinstance(args, dict) and args.get("algo"):
        return str(args["algo"])
    for marker, name in _ALGO_MARKERS:
        if any(marker in k for k in keys):
            return name
    return "unknown"


def _rank(meta: dict[str, str], path: Path, keys: list[str]) -> int | None:
    """`ss_network_dim`, else the first down-projection's row count (its shape only, no data read)."""
    if str(meta.get("ss_network_dim", "")).isdigit():
        return int(meta["ss_network_dim"])
    down = next((k for k in sorted(keys) if k.endswith(("lora_down.weight", "lora_A.weight", ".down.weight"))), None)
    if down is None:
        return None
    with safe_open(str(path), framework="pt") as handle:
        return int(handle.get_slice(down).get_shape()[0])


def read_card(name: str, path: Path, short_hash: str | None) -> CardInfo:
    """Build a card from the safetensors header of `path` (raises `AdapterFormatError` if it is not one)."""
    try:
        key_set, meta = read_header(path)
    except SafetensorsFileError as exc:
        raise AdapterFormatError(str(exc)) from None
    keys = sorted(key_set)
    base = meta.get("ss_base_model_version") or meta.get("modelspec.architecture") or meta.get("ss_sd_model_name")
    stat = path.stat()
    return CardInfo(name=name, base_model=base, trigger_words=_trigger_words(meta), rank=_rank(meta, path, keys),
                    alpha=meta.get("ss_network_alpha"), algorithm=_algorithm(meta, keys), short_hash=short_hash,
                    size_bytes=stat.st_size, modified=stat.st_mtime)


def base_badge(base_model: str | None) -> str:
    """The short family name a badge shows for a recorded base model (kohya's `ss_base_model_version`
    or `modelspec.architecture`), from the families' adapter markers; "unknown" when none is recorded."""
    if not base_model:
        return "unknown"
    found = lora_arch_of(base_model)
    return base_model[:16] if found is None else found[1]


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def state_badge(state: LoraState | None, counters: LoraCounters | None, fit: Fit | None) -> str:
    """The engine's word on one selected LoRA — applied (with what it matched), set aside or disabled
    (with the engine's reason) — and, under it, the inspect report of an applied file."""
    if state is None:
        badge = "<span class='sd-badge sd-badge-error'>✗ not applied</span> the engine refused the list (see below)"
    elif state.status == "applied":
        layers = f": {counters.matched_layers} layers" if counters is not None else ""
        badge = (f"<span class='sd-badge sd-badge-ok'>✓ applied{layers}</span> UNet {state.unet_shown} / "
                 f"TE {state.te_strength:g}")
        if counters is not None and counters.unmatched_keys:
            badge += f" <span class='sd-badge sd-badge-warn'>⚠ {counters.unmatched_keys} tensors matched nothing</span>"
    elif state.status == "set aside":
        badge = f"<span class='sd-badge sd-badge-warn'>⊘ set aside</span> {html.escape(state.reason)}"
    elif state.status == "disabled":
        badge = f"<span class='sd-badge sd-badge-error'>✗ disabled</span> {html.escape(state.reason)}"
    else:
        badge = f"<span class='sd-badge'>{html.escape(state.status)}</span>"
    report = fit.report_line() if fit is not None and state is not None and state.status == "applied" else ""
    return f"{badge}\n\n{report}" if report else badge


def card_markdown(card: CardInfo | None, name: str, badge: str = "", problem: str = "") -> str:
    """Card body: the engine's badge first (the panel's cards; the LoRA browser has none), then the
    metadata the file carries."""
    lines = [f"**{html.escape(name)}**"]
    if problem:
        lines.append(f"<span class='sd-badge sd-badge-error'>⚠ unreadable</span> {html.escape(problem)}")
        return "\n\n".join(lines)
    if badge:
        lines.append(badge)
    if card is not None:
        rank = f"rank: {card.rank if card.rank is not None else '?'}" + (f" (alpha {card.alpha})" if card.alpha else "")
        facts = [f"base model: <span class='sd-badge'>{html.escape(base_badge(card.base_model))}</span> "
                 f"{html.escape(card.base_model or 'not recorded')}",
                 f"algorithm: {html.escape(card.algorithm)}", rank,
                 (f"hash: `{card.short_hash}` · " if card.short_hash else "") + _size(card.size_bytes)]
        if card.trigger_words:
            facts.append("trigger words: " + ", ".join(f"`{html.escape(w)}`" for w in card.trigger_words))
        lines.append(" · ".join(facts))
    return "\n\n".join(lines)


class CardCache:
    """Cards by file identity and fit results by (model hash, file identity); thread-safe."""

    def __init__(self) -> None:
        self._cards: dict[tuple, CardInfo] = {}
        self._fits: dict[tuple, Fit] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _identity(path: Path) -> tuple:
        stat = path.stat()
        return str(path), stat.st_mtime_ns, stat.st_size

    def card(self, name: str, path: Path, hashed: bool = True) -> CardInfo:
        """The card of `path`; `hashed=False` skips hashing the whole file (listing a folder of LoRAs)."""
        key = self._identity(path)
        with self._lock:
            card = self._cards.get(key)
        if card is not None and (card.short_hash or not hashed):
            return card
        # The header is read (and a corrupt file refused, with the engine's own words) before the hash, which
        # would seek past the end of a file whose header length is garbage and say only "cannot fit 'int'…".
        card = read_card(name, path, None)
        if hashed:
            card = dataclasses.replace(card, short_hash=lora_short_hash(path))
        with self._lock:
            self._cards[key] = card
        return card

    def fit(self, engine, name: str, path: Path, model_key: str | None, ask: bool = True) -> Fit | None:
        """What the engine's `inspect_lora` says about `name` on the loaded model; a refusal becomes an
        "error" fit. With `ask=False` only a known answer is given (None when there is none), so a
        caller never waits behind a running generation for it."""
        if model_key is None:
            return Fit("warn", "no model loaded yet: fit not checked")
        key = (model_key, *self._identity(path))
        with self._lock:
            if key in self._fits or not ask:
                return self._fits.get(key)
        try:
            report = engine.inspect_lora(name)
        except AdapterError as exc:  # the file does not fit this model: a result to show, and to cache
            fit = Fit("error", str(exc))
        except Exception as exc:  # engine busy in ERROR, file vanished …: show it, but ask again next time
            return Fit("warn", f"fit not checked: {exc}")
        else:
            fit = Fit.from_report(report)
        with self._lock:
            self._fits[key] = fit
        return fit
