"""Diagonal OFT: block-orthogonal rotation of the base weight."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from app.adapters.algos.base import Adapter, _algorithm, _f32, _read_scalar, _require
from app.adapters.errors import AdapterFormatError, IncompatibleAdapterError


@_algorithm
class OFT(Adapter):
    """Diagonal OFT: W′ = rescale ⊙ (blockdiag(R)ᵀ · W), R = (I + Q)(I − Q)⁻¹, Q = B − Bᵀ per block.

    `blocks` (n, b, b) split the out axis into n blocks of b rows. R is orthogonal (Cayley
    transform of a skew matrix); `rotation()` exposes it. `constraint` bounds ‖Q‖_F over all
    blocks (COFT): Q is scaled down to that norm when it exceeds it. From a file it is the
    `constraint` tensor if present, else `alpha` × out_dim — the bound LyCORIS's Diag-OFT and
    kohya's OFT enforced while training (they store the per-row factor as `alpha`); ComfyUI
    clamps at `alpha` itself, which shrinks rotations the trainer allowed. 0 or absent: none.
    """

    blocks: Tensor
    rescale: Tensor | None = None
    constraint: float | None = None

    algo = "OFT"
    reads_base = True
    keys = frozenset({"oft_blocks", "rescale", "alpha", "constraint"})
    markers = frozenset({"oft_blocks"})

    @classmethod
    def from_tensors(cls, layer: str, tensors: Mapping[str, Tensor]) -> OFT:
        _require(layer, cls.algo, tensors, ("oft_blocks",))
        blocks = tensors["oft_blocks"]
        constraint = _read_scalar(layer, "constraint", tensors)
        if constraint is None and (alpha := _read_scalar(layer, "alpha", tensors)):
            constraint = alpha * math.prod(blocks.shape[:2])
        return cls(blocks, tensors.get("rescale"), constraint or None, layer=layer)

    def __post_init__(self) -> None:
        shape = tuple(self.blocks.shape)
        if len(shape) != 3 or shape[1] != shape[2]:
            raise AdapterFormatError(f"{self._where}: oft_blocks must be (blocks, size, size), got {shape}")
        if self.rescale is not None and (
            self.rescale.shape[0] != self.out_dim or any(d != 1 for d in self.rescale.shape[1:])
        ):
            raise AdapterFormatError(
                f"{self._where}: rescale must be ({self.out_dim}, 1, …), got {tuple(self.rescale.shape)}"
            )

    @property
    def out_dim(self) -> int:
        return self.blocks.shape[0] * self.blocks.shape[1]

    def validate_against(self, base_weight_shape: Sequence[int]) -> None:
        if len(base_weight_shape) < 1 or base_weight_shape[0] != self.out_dim:
            n, b = self.blocks.shape[:2]
            raise IncompatibleAdapterError(
                f"{self._where}: OFT rotates {n}×{b} = {self.out_dim} output rows but the target weight is "
                f"{tuple(base_weight_shape)}"
            )

    def rotation(self, device: torch.device | None = None) -> Tensor:
        """The per-block orthogonal matrices R (n, b, b), float32, after the constraint."""
        blocks = _f32(self.blocks, self.blocks.device if device is None else device)
        q = blocks - blocks.transpose(1, 2)
        if self.constraint:
            # Scale Q down to the bound when ‖Q‖_F (all blocks together) exceeds it; clamp, not an
            # `if`, so a GPU tensor is never synchronised to the host here.
            q = q * torch.clamp(self.constraint / torch.linalg.vector_norm(q), max=1.0)
        eye = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype)
        # (I + Q) and (I − Q)⁻¹ commute, so R = solve(I − Q, I + Q): no explicit inverse.
        return torch.linalg.solve(eye - q, eye + q)

    def rows(self, index: Tensor) -> OFT:
        """Whole rotation blocks only: each block rotates its own rows (a fused layer split at block
        boundaries); a split through a block would need the other part's rows."""
        size = self.blocks.shape[1]
        grid = index.reshape(-1, size) if index.numel() % size == 0 else None
        aligned = grid is not None and bool((grid == grid[:, :1] + torch.arange(size)).all()) \
            and bool((grid[:, 0] % size == 0).all())
        if not aligned:
            raise AdapterFormatError(f"{self._where}: OFT blocks of {size} rows do not align with the parts of this "
                                     "fused layer; not supported, nothing applied")
        rescale = None if self.rescale is None else self.rescale.index_select(0, index.to(self.rescale.device))
        block_index = (grid[:, 0] // size).to(self.blocks.device)
        return dataclasses.replace(self, blocks=self.blocks.index_select(0, block_index), rescale=rescale)

    def _weight_delta(self, w0: Tensor) -> Tensor:
        w = w0.to(torch.float32)
        r = self.rotation(w0.device)
        n, b = self.blocks.shape[:2]
        rotated = torch.einsum("k n m, k n x -> k m x", r, w.reshape(n, b, -1)).reshape(w.shape)
        if self.rescale is not None:
            rotated = rotated * _f32(self.rescale, w0.device).reshape(-1, *[1] * (w.dim() - 1))
        return rotated - w


