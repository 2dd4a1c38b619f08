"""The compiled denoiser fast path: `torch.compile` (with CUDA graphs in `reduce-overhead` mode) behind
the same `nn.Module`; for a family that names its repeated blocks (`Family.compile_regions`, the DiTs)
only those blocks, each class compiled once (app/engine/compile_regions.py), in `default` mode.

Why LoRAs stay live under compilation: the patcher writes fused weights with `copy_` into the
existing parameters, so every parameter keeps its identity, dtype, device, shape and address.
Dynamo guards on exactly that metadata and CUDA graphs on those addresses, so adding, re-weighting
and removing LoRAs neither recompiles nor re-captures: the next replay simply reads the new values.
Anything that *replaces* a parameter (an offload move, a placement repair) does invalidate them,
which is why only offload `none` is compiled; the modes that move weights run eager with a note.

How it is wired: `enable(pipe)` sets one instance attribute, `pipe.unet.forward`, to
`CompileState.forward`; the module object, its parameters and its hooks stay what placement, the
verifier and the patcher already know, and `disable(pipe)` deletes that attribute again. Compiled
by regions, `CompileState.forward` is installed the same way and its compiled call is the plain
forward with the blocks' shared compiled forwards switched on for that call (`Regions.run`).
`CompileState.forward` dispatches per call signature (shapes, dtypes, flags): a signature whose
graph is compiled ("warmed") runs compiled, anything else runs the plain eager forward. With
`background=True` (the engine) a new signature starts a compile on a helper thread and the call
itself runs eager, so the app stays usable during the first compile (~1 min for SD1.5 on an H100);
with `background=False` (benchmarks, tests) the first call compiles in line.

How compiles are counted (`app/engine/compile_counting.py`): the dynamo backend is wrapped by
`CountingBackend`, which counts every FX graph dynamo hands to the real backend (one per compiled
signature when the UNet traces as one graph, more if it graph-breaks). CUDA-graph recordings are
counted from dynamo's compile callbacks (trigger `CUDAGRAPH_RECORDING`) where the installed torch
has them; otherwise that count is None.
A LoRA change must leave both counts unchanged; tests and the benchmark assert it.

Compiled artifacts survive restarts through torch's own caches (app/engine/compile_cache.py).

Each distinct signature (image size, batch, prompt length) compiles once, up to torch's recompile
limit (8); later ones stay eager and the status says so. Only the first `MAX_TEXT_LENGTHS` prompt
lengths compile (77-token chunk counts for CLIP; a family whose denoiser reads its prompt otherwise
says how to read its length, `Family.prompt_length`: a caption's token count), the others run eager
with a note (padding to a bucket would change the image where a model pads captions with a learned token).
A background compile runs one extra UNet forward beside the generation in flight, so it needs that
much more VRAM; on a small GPU prefer `background=False`.

One compiled UNet per process: `close()` calls `torch._dynamo.reset()`, which drops every compiled
graph (the entries live on the shared `UNet2DConditionModel.forward` code object) and frees the
CUDA-graph memory pools.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from app.engine.compile_cache import configure_cache, load_mega_cache, save_mega_cache
from app.engine.compile_counting import CountingBackend, RecordingCounter
from app.engine.compile_regions import Regions
from app.engine.offload import MODES
from app.families import family_of

log = logging.getLogger(__name__)

COMPILE_MODES = ("reduce-overhead", "default")
MAX_TEXT_LENGTHS = 3  # distinct prompt lengths (chunk counts) compiled; others run eager
FIRST_COMPILE_HINT = "the first compile takes ~1 min for SD1.5 and ~2-3 min for SDXL; seconds when cached"
REGIONS_HINT = "each repeated block class compiles once; seconds when cached"


def is_compiled_path_allowed(offload: str, device: torch.device, backend: str = "inductor") -> tuple[bool, str]:
    """Whether the compiled path may run; when not, the note the UI shows instead."""
    if MODES[offload].moves_weights:  # weights change device between generations: graphs would go stale
        return False, (f"offload '{offload}' moves UNet weights between devices, which invalidates compiled "
                       "graphs; running eager (use offload 'none' for the compiled path)")
    if backend == "inductor" and torch.device(device).type != "cuda":
        return False, "the compiled path needs a CUDA device; running eager"
    return True, ""


def _leaf_key(value) -> object:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device)
    if isinstance(value, dict):
        return ("dict", tuple((k, _leaf_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_leaf_key(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    return (type(value).__name__,)


def signature_key(args: tuple, kwargs: dict) -> tuple:
    """What makes two UNet calls share a compiled graph: argument structure, tensor shapes/dtypes/
    devices, and plain values (flags such as `return_dict`). Runs on every UNet call, hence the
    hand-written walk (a few microseconds) instead of a generic pytree flatten."""
    return _leaf_key(args), _leaf_key(kwargs)


def encoder_states_length(args: tuple, kwargs: dict) -> int | None:
    """A denoiser call's prompt length: axis 1 of its `encoder_hidden_states` (UNets, FLUX); a family
    whose denoiser takes its prompt otherwise says how to read it (`Family.prompt_length`)."""
    states = kwargs.get("encoder_hidden_states")
    return states.shape[1] if isinstance(states, torch.Tensor) and states.dim() == 3 else None


def describe_call(args: tuple, kwargs: dict) -> str:
    """A short label of a call for notes: the first tensor's shape and dtype (the CFG latent batch)."""
    first = next((x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None)
    if first is None:
        return "no tensor inputs"
    return "latents " + "x".join(map(str, first.shape)) + f" {str(first.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class CompileStatus:
    """An immutable picture of the compiled path for snapshots and the bench."""

    phase: str  # "eager" (not allowed) | "waiting" | "compiling" | "compiled" | "failed" | "closed"
    mode: str
    backend: str
    compiles: int
    cudagraph_recordings: int | None
    shapes_ready: int
    note: str
    compile_seconds: tuple[tuple[str, float], ...] = ()
    regions: tuple[str, ...] = ()  # the block classes compiled by regions; (): the whole denoiser


def _cuda_device(args: tuple) -> torch.device | None:
    """The CUDA device of the first tensor among the inputs, if they are on one."""
    first = next((x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)), None)
    return first.device if first is not None and first.device.type == "cuda" else None


def _device_context(args: tuple):
    """Make the inputs' CUDA device current on a helper thread (threads start on device 0)."""
    device = _cuda_device(args)
    return contextlib.nullcontext() if device is None else torch.cuda.device(device)


class CompileState:
    """The compiled path of one UNet: per-signature dispatch and warm-up, counters, teardown.

    `_run_lock` is held whenever compiled code runs or compiles, so dynamo and the CUDA-graph tree
    are never entered by two threads at once; a call that finds it taken (a compile in flight on
    the helper thread) runs eager rather than wait. A state built with a `blocked_note` (offload
    moves weights, no CUDA) installs nothing and only reports why. With `regions` (block class names)
    only those blocks compile, in `default` mode whatever `mode` asks (see compile_regions.py).
    """

    def __init__(self, unet: torch.nn.Module, *, mode: str = "reduce-overhead", backend="inductor",
                 background: bool = True, mega_cache: Path | None = None, blocked_note: str = "",
                 prompt_length: Callable[[tuple, dict], int | None] = encoder_states_length,
                 regions: tuple[str, ...] = ()) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
        self.unet = unet
        self.mode = "default" if regions else mode
        self.backend = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
        self.blocked_note = blocked_note
        self._background = background
        self._mega_cache = mega_cache
        self._cudagraphs = backend == "inductor" and mode == "reduce-overhead"
        self._max_shapes = int(getattr(torch._dynamo.config, "recompile_limit", 8))
        self._ready: dict[tuple, str] = {}  # signature -> label
        self._failed: dict[tuple, str] = {}  # signature -> "label: error"
        self._prompt_length = prompt_length
        self._lengths: set[int] = set()  # text lengths compiled or being compiled
        self._long = False  # a text length past MAX_TEXT_LENGTHS ran eager
        self._seconds: dict[str, float] = {}  # label -> wall time of its first (compiling) call
        self._warming: tuple[str, float] | None = None  # (label, monotonic start) of the compile in flight
        self._thread: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._closed = False
        self._counter = self._recordings = self._compiled = self._regions = None
        if blocked_note:
            return
        self._eager = type(unet).forward.__get__(unet)
        self._counter = CountingBackend(backend, self.mode)
        if regions:
            self._regions = Regions(unet, regions, self._counter)
            self._compiled = lambda *args, **kwargs: self._regions.run(self._eager, args, kwargs)
        else:
            self._compiled = torch.compile(self._eager, backend=self._counter, dynamic=False)
        self._recordings = RecordingCounter()
        unet.forward = self.forward

    # ------------------------------------------------------------------ counters and status
    @property
    def compiles(self) -> int:
        """Graphs compiled so far (see the module docstring for what counts)."""
        return 0 if self._counter is None else self._counter.graphs

    @property
    def config_patches(self) -> dict:
        """The inductor options the mode applies (`reduce-overhead`: CUDA graphs); empty otherwise."""
        return {} if self._counter is None else dict(self._counter.config_patches)

    @property
    def cudagraph_recordings(self) -> int | None:
        return None if self._recordings is None else self._recordings.count

    @property
    def note(self) -> str:
        return self.status().note

    @property
    def phase(self) -> str:
        return self.status().phase

    def status(self) -> CompileStatus:
        with self._state_lock:
            ready, failed, warming = dict(self._ready), dict(self._failed), self._warming
            seconds = tuple(self._seconds.items())
        phase, note = self._describe(ready, failed, warming)
        return CompileStatus(phase, self.mode, self.backend, self.compiles, self.cudagraph_recordings,
                             len(ready), note, seconds, () if self._regions is None else self._regions.classes)

    def _describe(self, ready: dict, failed: dict, warming: tuple[str, float] | None) -> tuple[str, str]:
        if self._closed:
            return "closed", "compiled path off"
        if self.blocked_note:
            return "eager", self.blocked_note
        what, hint = ("the UNet", FIRST_COMPILE_HINT) if self._regions is None else \
            (f"the {', '.join(self._regions.classes)} blocks", REGIONS_HINT)
        if warming is not None:
            label, started = warming
            phase, note = "compiling", (f"compiling {what} for {label}, {time.monotonic() - started:.0f} s so far "
                                        f"({hint}); generating eagerly meanwhile")
        elif ready:
            phase, note = "compiled", f"compiled {what} ({self.mode}) for {len(ready)} input sizes"
        elif failed:
            phase, note = "failed", "compiling failed; running eager"
        else:
            phase, note = "waiting", (f"compiled path on for {what} ({self.mode}): each new image size compiles "
                                      f"once, {hint}")
        if failed:
            note += "; failed: " + "; ".join(failed.values()) + " (those sizes run eager)"
        if len(ready) + len(failed) >= self._max_shapes:
            note += f"; {self._max_shapes} sizes compiled, the torch limit: further sizes run eager"
        if self._long:
            note += f"; prompts of more than {MAX_TEXT_LENGTHS} lengths: the others run eager"
        return phase, note

    # ------------------------------------------------------------------ dispatch
    def forward(self, *args, **kwargs):
        """The UNet's forward: compiled for warmed signatures, otherwise eager (compiling first
        in line, or starting a background compile, when the signature is new)."""
        key = signature_key(args, kwargs)
        if key in self._ready and self._run_lock.acquire(blocking=False):
            try:
                return self._run_compiled(args, kwargs)
            finally:
                self._run_lock.release()
        if self._may_compile(key, self._prompt_length(args, kwargs)):
            if not self._background:
                return self.warm(*args, **kwargs)
            self._start_warm(key, args, kwargs)
        return self._eager(*args, **kwargs)

    def _run_compiled(self, args: tuple, kwargs: dict):
        if self._cudagraphs:
            # Each UNet call is a new inference step: outputs of the previous replay may be reused.
            torch.compiler.cudagraph_mark_step_begin()
        return self._compiled(*args, **kwargs)

    def _may_compile(self, key: tuple, length: int | None) -> bool:
        if length is not None and length not in self._lengths and len(self._lengths) >= MAX_TEXT_LENGTHS:
            self._long = True
            return False
        busy = self._thread is not None and self._thread.is_alive()
        known = key in self._ready or key in self._failed
        full = len(self._ready) + len(self._failed) >= self._max_shapes
        return not (self._closed or busy or known or full)

    def warm(self, *args, **kwargs):
        """Compile (when new) and run the compiled forward for exactly this call; returns its output.
        A failure is recorded against the signature (which then stays eager) and re-raised."""
        key, label = signature_key(args, kwargs), describe_call(args, kwargs)
        self._lengths.add(self._prompt_length(args, kwargs))
        started = time.perf_counter()
        try:
            with self._run_lock:
                out = self._run_compiled(args, kwargs)
                device = _cuda_device(args)
                if device is not None:  # the compile time must include the GPU work it launched
                    torch.cuda.synchronize(device)
        except BaseException as exc:
            with self._state_lock:
                self._failed[key] = f"{label}: {type(exc).__name__}: {exc}"
            raise
        with self._state_lock:
            self._ready[key] = label
            self._seconds.setdefault(label, time.perf_counter() - started)
        self.save_cache()
        return out

    def _start_warm(self, key: tuple, args: tuple, kwargs: dict) -> None:
        inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
        with self._state_lock:
            if not self._may_compile(key, self._prompt_length(args, kwargs)):
                return
            self._warming = (describe_call(args, kwargs), time.monotonic())
            self._thread = threading.Thread(target=self._warm_in_background, args=(inputs, torch.is_grad_enabled()),
                                            name="unet-compile", daemon=True)
            self._thread.start()

    def _warm_in_background(self, inputs: tuple, grad_enabled: bool) -> None:
        args, kwargs = inputs
        try:
            with torch.set_grad_enabled(grad_enabled), _device_context(args):
                self.warm(*args, **kwargs)
        except Exception:  # noqa: BLE001 - recorded by warm() and shown in the status; eager keeps working
            log.warning("background UNet compile failed; that input size stays eager", exc_info=True)
        finally:
            with self._state_lock:
                self._warming = None

    # ------------------------------------------------------------------ lifecycle
    def wait(self, timeout: float | None = None) -> bool:
        """Block until a background compile in flight is done; True when none is left running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def save_cache(self) -> bool:
        """Save the mega-cache (when a cache folder was configured); a disk error is only logged."""
        if self._mega_cache is None:
            return False
        try:
            return save_mega_cache(self._mega_cache)
        except OSError as exc:
            log.warning("could not save the compile cache to %s: %s", self._mega_cache, str(exc))
            return False

    def close(self) -> None:
        """Wait for a compile in flight, restore the plain forward and drop every compiled graph."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        if self.blocked_note:
            return
        if installed_state(self.unet) is self:
            del self.unet.forward
        if self._regions is not None:
            self._regions.close()
        self._recordings.close()
        self._compiled = None
        torch._dynamo.reset()


def installed_state(unet: torch.nn.Module) -> CompileState | None:
    """The CompileState whose forward is installed on `unet`, if any."""
    owner = getattr(vars(unet).get("forward"), "__self__", None)
    return owner if isinstance(owner, CompileState) else None


def enable(pipe, *, offload: str = "none", mode: str = "reduce-overhead", backend="inductor",
           background: bool | None = True, cache_dir: Path | None = None, device: torch.device | None = None,
           whole: bool = False) -> CompileState:
    """Compile the pipeline's denoiser (`pipe.unet`, a DiT's `pipe.transformer`), replacing a previous
    compiled state, or explain why it stays eager. A family with `compile_regions` compiles its repeated
    blocks only, unless `whole`.

    `backend` is `inductor` on the GPU path; tests pass `eager`/`aot_eager` (or a callable) to run
    the same dispatch and counting on the CPU in seconds. `cache_dir` keeps compiled artifacts
    across restarts (see `compile_cache.configure_cache`). `background=None`: compile on a helper thread
    unless CUDA graphs are recorded (a CUDA-graph tree belongs to the thread that records it).
    """
    disable(pipe)
    device = torch.device(device if device is not None else pipe._execution_device)
    allowed, note = is_compiled_path_allowed(offload, device, backend if isinstance(backend, str) else "custom")
    mega_cache = None
    if allowed and cache_dir is not None:
        mega_cache = configure_cache(cache_dir)
        load_mega_cache(mega_cache)
    fam, denoiser = family_of(pipe), _denoiser(pipe)
    regions = () if whole or fam.compile_regions is None else fam.compile_regions(denoiser)
    if background is None:
        background = bool(regions) or mode == "default"
    return CompileState(denoiser, mode=mode, backend=backend, background=background, mega_cache=mega_cache,
                        blocked_note=note, prompt_length=fam.prompt_length or encoder_states_length, regions=regions)


def _denoiser(pipe) -> torch.nn.Module:
    """The denoising component of the pipeline's family (`unet`, or `transformer` for DiTs)."""
    return getattr(pipe, family_of(pipe).denoiser)


def disable(pipe) -> None:
    """Remove the compiled path from the denoiser (no-op when none is installed)."""
    state = installed_state(_denoiser(pipe))
    if state is not None:
        state.close()
