"""One engine per device behind one dispatcher: `--devices cuda:0,cuda:1`, `--devices all`.

Why several engines and not one engine over several GPUs: an engine's promise (one writer, every
tensor verified against its plan) holds per model copy, so each device gets a whole `Engine` of its
own: its worker, queue, placement plan, verify and history, its own Diagnostics section. The pool
only decides where a job goes and forwards the calls the UI and the APIs make:

* a job (generate, img2img, inpaint, hires fix, refiner, reference edit) carries its `Desired`;
  it goes to the engine where it costs least, counted in jobs: the jobs already in hand there, plus
  `REPATCH_COST` when that engine holds the checkpoint with other LoRAs (a re-patch, milliseconds
  on a GPU) or `RELOAD_COST` when it holds another checkpoint, dtype or storage. So an engine
  holding the job's model and LoRA set gets it when it is among the least busy, a second identical
  job goes to an idle engine rather than wait, and a job waits behind one job rather than reload a
  model. "Holds" counts the jobs already sent to an engine: its last one's state is what it will
  hold when the new one's turn comes;
* Extras (an upscaler, no diffusion model) goes to the engine with the fewest jobs in hand;
* Interrupt, Skip and a closed tab's cancel reach every engine, and each stops only that owner's job,
  so they reach the engine running it;
* the page's changes (load a model, set LoRAs, dtype, offload) go to the first engine, whose answer
  the panel draws; each job then reconciles on the engine it runs on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from app.engine.desired import Desired
from app.engine.snapshot import Snapshot
from app.engine.worker import Engine
from app.settings import Settings

T = TypeVar("T")
REPATCH_COST = 0.5  # in jobs waiting: what re-patching LoRAs (or re-placing for another offload mode) is worth
RELOAD_COST = 1.5  # in jobs waiting: what loading another checkpoint (or dtype, or storage) is worth


def resolve_devices(devices: tuple[str, ...]) -> tuple[str, ...]:
    """`("all",)` -> every CUDA device (the CPU when there is none); anything else as given."""
    if tuple(devices) != ("all",):
        return tuple(devices)
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return tuple(f"cuda:{i}" for i in range(count)) or ("cpu",)


def make_engine(settings: Settings) -> Engine | EnginePool:
    """One `Engine` on `settings.device`, or a pool when `settings.devices` names more than one."""
    devices = resolve_devices(settings.devices) if settings.devices else (settings.device,)
    if len(devices) == 1:
        return Engine(settings.replace(device=devices[0], devices=()))
    return EnginePool(settings, devices)


def _on_first(name: str):
    def call(self, *args, **kwargs):
        return getattr(self.primary, name)(*args, **kwargs)
    call.__name__ = name
    call.__doc__ = (f"`Engine.{name}` on the first engine: the page draws its answer, and every job reconciles "
                    "on the engine it runs on.")
    return call


def _of_first(name: str, doc: str) -> property:
    """The first engine's attribute `name`, read-only: one object every engine shares the meaning of."""
    return property(lambda self: getattr(self.primary, name), doc=doc)


class EnginePool:
    """The calls of `Engine` the UI and the APIs make, over one engine per device (module docstring)."""

    def __init__(self, settings: Settings, devices: tuple[str, ...]) -> None:
        self.settings = settings
        self.engines = tuple(Engine(settings.replace(device=device, devices=())) for device in devices)
        self._lock = threading.Lock()
        self._in_hand = [0] * len(self.engines)  # jobs sent to each engine and not answered yet
        self._last: list[Desired | None] = [None] * len(self.engines)  # the state of the last job sent to each

    @property
    def primary(self) -> Engine:
        return self.engines[0]

    library = _of_first("library", "The first engine's LoRA library: every engine reads the same folder.")
    upscalers = _of_first("upscalers", "The first engine's upscaler library: every engine reads the same folder.")
    timeline = _of_first("timeline", "Process memory over time (one process for all engines), sampled by the "
                                     "first engine.")
    load_model = _on_first("load_model")
    set_dtype = _on_first("set_dtype")
    set_weights = _on_first("set_weights")
    set_model_parts = _on_first("set_model_parts")
    set_offload = _on_first("set_offload")
    set_loras = _on_first("set_loras")
    set_lora_partial = _on_first("set_lora_partial")
    lora_partial_allowed = _on_first("lora_partial_allowed")
    inspect_lora = _on_first("inspect_lora")
    unload = _on_first("unload")
    snapshot = _on_first("snapshot")
    hires_upscalers = _on_first("hires_upscalers")
    extras_upscalers = _on_first("extras_upscalers")
    check_upscaler = _on_first("check_upscaler")
    check_face_restorer = _on_first("check_face_restorer")

    def unload_upscaler(self) -> Snapshot:
        """Every engine gives its upscaler's memory back; the first one's snapshot, as `Engine`'s."""
        return [engine.unload_upscaler() for engine in self.engines][0]

    def runs_for(self, owner: str) -> bool:
        return any(engine.runs_for(owner) for engine in self.engines)

    def snapshots(self) -> tuple[Snapshot, ...]:
        return tuple(engine.snapshot() for engine in self.engines)

    def in_hand(self) -> tuple[int, ...]:
        """Jobs each engine has been sent and not answered yet (running or waiting)."""
        with self._lock:
            return tuple(self._in_hand)

    # ------------------------------------------------------------------ jobs
    def generate(self, params, *, owner: str | None = None, hires=None, desired: Desired | None = None):
        return self._dispatch(desired, lambda engine, want: engine.generate(params, owner=owner, hires=hires,
                                                                            desired=want))

    def img2img(self, params, init_images, *, desired: Desired | None = None, **options):
        return self._dispatch(desired, lambda engine, want: engine.img2img(params, init_images, desired=want,
                                                                           **options))

    def edit(self, params, references, *, owner: str | None = None, desired: Desired | None = None):
        return self._dispatch(desired, lambda engine, want: engine.edit(params, references, owner=owner,
                                                                        desired=want))

    def extras(self, images, params, *, owner: str | None = None):
        """Extras runs no diffusion model (so it carries no `Desired`): the engine with the fewest jobs in hand."""
        with self._lock:
            index = min(range(len(self.engines)), key=lambda i: (self._in_hand[i], i))
            self._in_hand[index] += 1
        return self._answered(index, lambda: self.engines[index].extras(images, params, owner=owner))

    def choose(self, want: Desired) -> int:
        """The engine for a job needing `want` (see the module docstring); the caller holds the lock."""
        def cost(index: int) -> float:
            held = (self._in_hand[index] and self._last[index]) or self.engines[index].snapshot().desired
            if want.same_as(held):
                return self._in_hand[index]
            return self._in_hand[index] + (REPATCH_COST if want.model_key() == held.model_key() else RELOAD_COST)
        return min(range(len(self.engines)), key=lambda i: (cost(i), i))

    def _dispatch(self, desired: Desired | None, call: Callable[[Engine, Desired], T]) -> T:
        """Run `call(engine, want)` on the chosen engine; `want` is `desired` completed from the first
        engine's state (a job that names no state or no model follows what the page set there)."""
        held = self.primary.snapshot().desired
        want = held if desired is None else desired
        want = want if want.model else want.replace(model=held.model)
        with self._lock:
            index = self.choose(want)
            self._in_hand[index] += 1
            self._last[index] = want
        return self._answered(index, lambda: call(self.engines[index], want))

    def _answered(self, index: int, call: Callable[[], T]) -> T:
        """`call()`, the job counted in hand on engine `index` (counted by the caller) until it answers."""
        try:
            return call()
        finally:
            with self._lock:
                self._in_hand[index] -= 1

    # ------------------------------------------------------------------ stopping, every engine
    def interrupt(self, *, keep_partial: bool = True, owner: str | None = None) -> bool:
        return any([engine.interrupt(keep_partial=keep_partial, owner=owner) for engine in self.engines])

    def skip(self, *, owner: str | None = None) -> bool:
        return any([engine.skip(owner=owner) for engine in self.engines])

    def cancel_queued(self, owner: str) -> int:
        return sum(engine.cancel_queued(owner) for engine in self.engines)

    def set_debug(self, **switches: Any) -> Settings:
        for engine in self.engines:
            engine.set_debug(**switches)
        self.settings = self.settings.replace(**{k: v for k, v in switches.items() if v is not None})
        return self.settings

    def take_turns_by(self, account_of: Callable[[str | None], str | None]) -> None:
        """`Engine.take_turns_by` on every engine."""
        for engine in self.engines:
            engine.take_turns_by(account_of)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
