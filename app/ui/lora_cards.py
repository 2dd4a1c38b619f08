"""LoRA cards: what a file says about itself (safetensors metadata) and whether it fits the model.

Metadata comes from the file header only (no tensor data is read), so listing a folder of large
LoRAs stays cheap and never touches the engine's LoRA cache, which belongs to the worker. The
fit check asks the engine (`inspect_lora`), which parses the file against the loaded model on
its worker thread; results are cached per (model hash, file identity) because a LoRA's fit
only changes when either side changes.
"""

from __future__ import annotations

import html
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from app.adapters.errors import AdapterError, AdapterFormatError
from app.adapters.matching import MatchReport
from app.safetensors_files import SafetensorsFileError, file_sha256, read_header

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
    """Outcome of the fit check: level "ok", "warn" (some tensors unmatched) or "error" (refused),
    with the per-file report of an accepted file (`MatchReport`: layout, scale source, the first
    unmatched tensor names, the architecture it fits)."""

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
        level = "error" if report.matched_layers == 0 else "warn" if report.unmatched_keys else "ok"
        return cls(level, report.message or ("matched zero layers" if level == "error" else ""),
                   report.matched_layers, report.unmatched_keys, report.layout, report.scale_source,
                   report.unmatched_examples, report.fits)

    def report_line(self) -> str:
        """layout · scale source · what was left over, for an accepted file ("" before a check)."""
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


# (marker in the recorded base model, badge): kohya writes `ss_base_model_version` ("sd_v1",
# "sdxl_base_v1-0", "sd_v2_768_v", "flux1"), the model spec `modelspec.architecture`
# ("stable-diffusion-v1/lora", "stable-diffusion-xl-v1-base/lora"); first match wins.
_FAMILY_MARKERS = (("sdxl", "SDXL"), ("stable-diffusion-xl", "SDXL"), ("sd_v1", "SD1.5"),
                   ("stable-diffusion-v1", "SD1.5"), ("sd_v2", "SD2"), ("stable-diffusion-v2", "SD2"),
                   ("sd3", "SD3"), ("flux", "Flux"))


def base_badge(base_model: str | None) -> str:
    """The short family name a badge shows for a recorded base model; "unknown" when none is recorded."""
    if not base_model:
        return "unknown"
    lowered = base_model.lower()
    return next((badge for marker, badge in _FAMILY_MARKERS if marker in lowered), base_model[:16])


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _fit_badge(fit: Fit | None) -> str:
    """The fit badge and, when the file was matched, its per-file report (layout, scale, leftovers)."""
    if fit is None:
        return "<span class='sd-badge'>checking fit…</span>"
    if fit.level == "ok":
        badge = (f"<span class='sd-badge sd-badge-ok'>✓ fits {fit.fits}: {fit.matched_layers} layers</span>"
                 + (f" {html.escape(fit.message)}" if fit.message else ""))
    elif fit.level == "warn":
        badge = (f"<span class='sd-badge sd-badge-warn'>⚠ {fit.unmatched_keys} tensors matched nothing</span> "
                 f"{fit.matched_layers} layers patched{' (' + fit.fits + ')' if fit.fits else ''}; "
                 f"{html.escape(fit.message)}")
    else:
        badge = f"<span class='sd-badge sd-badge-error'>✗ does not fit — not applied</span> {html.escape(fit.message)}"
    report = fit.report_line()
    return f"{badge}\n\n{report}" if report else badge


def card_markdown(card: CardInfo | None, fit: Fit | None, name: str, problem: str = "",
                  show_fit: bool = True) -> str:
    """Card body: a fit badge first (never hidden where fit is shown), then the metadata the file carries.
    The LoRA browser leaves the fit out (`show_fit=False`): the panel's card shows it once selected."""
    lines = [f"**{html.escape(name)}**"]
    if problem:
        lines.append(f"<span class='sd-badge sd-badge-error'>⚠ unreadable</span> {html.escape(problem)}")
        return "\n\n".join(lines)
    if show_fit:
        lines.append(_fit_badge(fit))
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
        card = read_card(name, path, file_sha256(path)[:12] if hashed else None)
        with self._lock:
            self._cards[key] = card
        return card

    def fit(self, engine, name: str, path: Path, model_hash: str | None) -> Fit:
        """Ask the engine whether `name` fits the loaded model; a refusal becomes an "error" fit."""
        if model_hash is None:
            return Fit("warn", "no model loaded yet: fit not checked")
        key = (model_hash, *self._identity(path))
        with self._lock:
            if key in self._fits:
                return self._fits[key]
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
