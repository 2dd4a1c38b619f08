"""Reading a device tensor on the host without draining the GPU's queue.

`tensor.cpu()` and `bool(tensor)` queue their copy behind everything queued so far and wait for it.
In a denoising loop's step callback that includes the next step's first work, so the GPU's queue
empties and the next step starts from nothing: a 4-step DiT ran at 0.98× of diffusers' it/s on an
H100 until the NaN check stopped reading its flag that way (1.00× after). `HostRead` copies into
pinned host memory without blocking and records an event behind the copy on the tensor's stream;
`value()` waits on that event alone. Taken at step k and read at step k+1, it waits for step k's work,
never for what was queued after it. On the CPU it holds the tensor itself.
"""

from __future__ import annotations

import torch


class HostRead:
    """One tensor on its way to the host; `value()` is the host copy once its own copy is done."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(tensor.device))  # the copy's stream, on any device
            tensor = host
        self._tensor = tensor

    def value(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._tensor
