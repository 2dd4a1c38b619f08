"""What the compiled path counts: graphs dynamo compiles, and CUDA-graph recordings.

Why counted: a LoRA change must neither recompile nor re-record (the patcher writes fused weights in
place, so dynamo's guards and the CUDA graphs' addresses hold); `app/engine/compiled.py` reports
both counts and the tests and the benchmark assert that they stay put.
"""

from __future__ import annotations

import threading

import torch


class CountingBackend:
    """A dynamo backend that counts the graphs it compiles, then hands them to the real backend.

    For inductor the real backend is the object `torch.compile(mode=...)` itself builds (mode
    `reduce-overhead` = the `triton.cudagraphs` option); any other backend, a name or a callable,
    is used as is, e.g. `eager`/`aot_eager` in CPU tests.
    """

    def __init__(self, backend, mode: str) -> None:
        self.graphs = 0
        self._lock = threading.Lock()
        if backend == "inductor":
            self._compile = torch._TorchCompileInductorWrapper(None if mode == "default" else mode, None, False)
            self.config_patches = dict(self._compile.config)
        else:
            self._compile = backend if callable(backend) else torch._dynamo.lookup_backend(backend)
            self.config_patches = {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, **kwargs):
        with self._lock:
            self.graphs += 1
        return self._compile(gm, example_inputs, **kwargs)


class RecordingCounter:
    """Counts CUDA-graph recordings (process-wide) through dynamo's compile-start callbacks."""

    def __init__(self) -> None:
        trigger = getattr(getattr(torch._dynamo.callback, "CallbackTrigger", None), "CUDAGRAPH_RECORDING", None)
        self._trigger = trigger
        self.count: int | None = None if trigger is None else 0
        if trigger is not None:
            torch._dynamo.callback_handler.register_start_callback(self._on_start)

    def _on_start(self, args=None) -> None:
        if getattr(args, "callback_trigger", None) is self._trigger:
            self.count += 1

    def close(self) -> None:
        if self._trigger is not None and self._on_start in torch._dynamo.callback_handler.start_callbacks:
            torch._dynamo.callback_handler.remove_start_callback(self._on_start)
