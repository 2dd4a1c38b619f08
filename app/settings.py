"""Every user-facing option in one frozen dataclass.

`launch.py` turns command-line flags into a `Settings`; the engine, the UI and the bug report
read from it. Keeping it in one place lets the bug report dump the whole configuration (minus
secrets) and lets tests build an engine with a two-line override.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from app.adapters.specs import MAX_STRENGTH

DTYPE_CHOICES = ("auto", "fp16", "bf16", "fp32")
# "inductor" is the real compiled path (CUDA); "eager"/"aot_eager" run the same dispatch and counting
# on the CPU in seconds (the benchmark's smoke mode and tests).
COMPILE_BACKENDS = ("inductor", "eager", "aot_eager")
# The offload strategies' names, in order. Spelled here so that reading settings (`launch.py --help`,
# a mistyped flag) does not import torch and diffusers; `app.engine.offload` refuses to import if
# its strategy table and this tuple ever disagree.
OFFLOAD_CHOICES = ("none", "model", "balanced", "sequential", "group")
# How the large weights are kept (the same rule: `app.engine.storage` refuses to import if its modes differ).
WEIGHTS_CHOICES = ("full", "fp8", "fp8-compute", "int8")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    """Paths, engine policy and serving options.

    `data_dir` follows the A1111 layout so an existing install can be pointed at directly:
    `models/Stable-diffusion` (checkpoints: `.safetensors` files and diffusers folders),
    `models/Lora`, `embeddings`, `outputs`.
    """

    data_dir: Path = Path(".")
    device: str = "auto"  # "auto" = cuda when available, else cpu
    # One engine per entry ("cuda:0", "cuda:1", "cpu"; ("all",): every GPU) behind a dispatcher
    # (app/engine/pool.py); empty: one engine on `device`.
    devices: tuple[str, ...] = ()
    dtype: str = "auto"
    offload: str = "none"
    vram_budget_gib: float | None = None
    balanced_watermark: float = 0.85
    history_size: int = 200
    lora_cache_mib: int = 1024  # LoRA files kept in RAM after reading (a few typical ones; 0 = none)
    lora_debug: bool = field(default_factory=lambda: _env_flag("SD_LORA_DEBUG"))
    move_debug: bool = field(default_factory=lambda: _env_flag("SD_MOVE_DEBUG"))
    strict: bool = False
    strict_forwards: bool = False  # every module's forward checks its tensors' placement (app/engine/strict.py)
    max_lora_errors: int = 3
    slider_min: float = -2.0
    slider_max: float = 2.0
    compile: bool = False
    compile_mode: str = "reduce-overhead"  # or "default" (no CUDA graphs)
    # Compile the whole denoiser even where the family compiles its repeated blocks (`Family.compile_regions`:
    # the DiTs, in seconds rather than minutes, without CUDA graphs).
    compile_whole: bool = False
    # The dtype offloaded weights rest in (None: the compute dtype). A wider one than the compute
    # dtype (fp32 rest, bf16 compute) makes every offload mode really move and cast tensors on a
    # CPU-only machine: how CI runs the moving code without a GPU.
    rest_dtype: str | None = None
    # "fp8": large weights rest in 8 bits, computed in the compute dtype; "fp8-compute": the same, and the
    # Linear ones that qualify run as fp8 matmuls (CUDA sm89+ or the CPU; app/engine/fp8_matmul.py); "int8":
    # they rest as int8 with a float32 scale per output row, quantised on load (app/engine/codecs.py)
    weights: str = "full"
    # Where fused LoRAs' exact copies of the original weights rest when the weights are on a GPU:
    # "gpu" (beside the weight while 2 GiB stay free, else pinned host memory: a re-weight reads W0
    # without a host transfer, ~20 ms for 3 LoRAs on SD1.5) or "cpu" (pinned host memory, so LoRAs
    # cost no VRAM; every re-weight then copies each touched layer's original over PCIe). Issue 41.
    lora_backups: str = "gpu"
    # UNet and VAE convolution weights rest and compute channels_last (NHWC), which cuDNN runs without
    # converting each weight per call (an H100 profile spent 22.6% of CUDA time in that conversion).
    # Off by default until GPU benchmark rows confirm the speed-up; valid on the CPU too (oneDNN).
    channels_last: bool = False
    preview_every: int = 4  # steps between live previews of the latents while denoising (0: none)
    # zlib level of saved PNGs. Each image is written on the worker before the next job starts: a real 1024²
    # image takes ~5x longer at PIL's default 6 than at 1 for ~12% smaller files; 4 (ComfyUI's choice) is
    # ~2.5x faster than 6 and within 1% of its size. 0-9, as PIL reads it.
    png_compress_level: int = 4
    compile_backend: str = "inductor"
    # serving
    listen: bool = False
    port: int = 7860
    share: bool = False
    auth: tuple[tuple[str, str], ...] = ()
    no_auth: bool = False
    api: bool = False  # serve the A1111 API even when the app is reachable without a login
    api_auth: tuple[tuple[str, str], ...] = ()  # logins for the A1111 API only (else the UI's)
    # Logins that may change what every user shares (unload, debug, dtype/offload/storage, the remembered
    # per-LoRA choices, stopping others' jobs, the shared styles); none named: the first login (app/accounts.py).
    admins: tuple[str, ...] = ()
    queue_size: int = 64  # requests waiting in the app's queue, all sessions together
    session_queue_size: int = 8  # requests one browser tab or gradio_client session may have pending, of any kind
    account_queue_size: int = 8  # jobs one login may have waiting or running, UI and A1111 API together
    max_upload_mib: int = 16  # one upload request, all its files together
    max_upload_files: int = 16  # files in one upload request (a gallery's pictures come in one)
    account_upload_quota_mib: int = 256  # uploaded temp files one login may hold on disk at once
    # The memory one job may plan to use on top of the loaded models, in GiB, checked against its estimate
    # before it starts (app/engine/job_memory.py); None: a quarter of the RAM (on a GPU also half its memory).
    memory_budget_gib: float | None = None
    # Reverse proxies whose `X-Forwarded-For` names the client (the login throttle's key); none: the
    # socket's peer, so a local tunnel or script cannot pose as a new address per password guess.
    forwarded_allow_ips: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.compile_mode not in ("reduce-overhead", "default"):
            raise ValueError(f"compile_mode must be reduce-overhead or default, got {self.compile_mode!r}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend must be one of {COMPILE_BACKENDS}, got {self.compile_backend!r}")
        if self.offload not in OFFLOAD_CHOICES:
            raise ValueError(f"offload must be one of {OFFLOAD_CHOICES}, got {self.offload!r}")
        if self.weights not in WEIGHTS_CHOICES:
            raise ValueError(f"weights must be one of {WEIGHTS_CHOICES}, got {self.weights!r}")
        if self.lora_backups not in ("cpu", "gpu"):
            raise ValueError(f"lora_backups must be cpu or gpu, got {self.lora_backups!r}")
        if not 0 <= self.png_compress_level <= 9:
            raise ValueError(f"the PNG compression level is 0 (none) to 9 (smallest), got {self.png_compress_level}")
        if self.rest_dtype not in (None, "fp16", "bf16", "fp32"):
            raise ValueError(f"rest_dtype must be fp16, bf16 or fp32, got {self.rest_dtype!r}")
        if not 0 < self.balanced_watermark <= 1:
            raise ValueError(f"the VRAM watermark is a fraction of the GPU's memory in (0, 1], "
                             f"got {self.balanced_watermark}")
        if not -MAX_STRENGTH <= self.slider_min <= self.slider_max <= MAX_STRENGTH:
            raise ValueError(f"the slider range must lie within ±{MAX_STRENGTH:g} (the largest LoRA strength), "
                             f"got {self.slider_min}..{self.slider_max}")
        for name, minimum in (("lora_cache_mib", 0), ("queue_size", 1), ("session_queue_size", 1),
                              ("account_queue_size", 1), ("max_upload_mib", 1), ("max_upload_files", 1)):
            if getattr(self, name) < minimum:
                raise ValueError(f"{name} must be at least {minimum}, got {getattr(self, name)}")
        if self.account_upload_quota_mib < self.max_upload_mib:
            raise ValueError(f"account_upload_quota_mib must be at least max_upload_mib ({self.max_upload_mib}): one "
                             f"whole upload must fit in a login's quota, got {self.account_upload_quota_mib}")
        if any(not isinstance(d, str) or not d.strip() for d in self.devices) or (
                "all" in self.devices and len(self.devices) > 1):
            raise ValueError(f"devices must be device names (cuda:0, cpu …) or just all, got {self.devices!r}")
        self._check_admins()
        if self.memory_budget_gib is not None and not 0 < self.memory_budget_gib < float("inf"):
            raise ValueError(f"the memory budget must be a positive number of GiB, got {self.memory_budget_gib}")
        if self.vram_budget_gib is not None and not self.vram_budget_gib > 0:
            raise ValueError(f"the VRAM budget must be a positive number of GiB, got {self.vram_budget_gib}")
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())

    def _check_admins(self) -> None:
        """An `--admin` name must be one of the logins given (a typo would leave the app without an admin)."""
        users = {user for user, _password in (*self.auth, *self.api_auth)}
        unknown = [name for name in self.admins if not name or (users and name not in users)]
        if unknown:
            raise ValueError(f"--admin {', '.join(map(repr, unknown))}: not a login of --auth/--auth-file/--auth-env/"
                             "--api-auth")

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "models" / "Stable-diffusion"

    @property
    def lora_dir(self) -> Path:
        return self.data_dir / "models" / "Lora"

    @property
    def embeddings_dir(self) -> Path:
        return self.data_dir / "embeddings"

    @property
    def text_encoder_dir(self) -> Path:
        """Separate text-encoder files (Flux: `clip_l.safetensors`, `t5xxl_fp16.safetensors`), Forge's folder."""
        return self.data_dir / "models" / "text_encoder"

    @property
    def adetailer_dir(self) -> Path:
        """User detectors for the Detailer (ONNX YOLO exports), ADetailer's folder."""
        return self.data_dir / "models" / "adetailer"

    @property
    def vae_dir(self) -> Path:
        """Separate VAE files (Flux: `ae.safetensors`), A1111's and Forge's folder."""
        return self.data_dir / "models" / "VAE"

    @property
    def controlnet_dir(self) -> Path:
        """ControlNet models (diffusers folders and single files), A1111's folder."""
        return self.data_dir / "models" / "ControlNet"

    @property
    def controlnet_preprocessor_dir(self) -> Path:
        """Model files of the model-based ControlNet preprocessors (`<module>.onnx`, `preprocessor_models`)."""
        return self.data_dir / "models" / "ControlNetPreprocessor"

    @property
    def part_choices_file(self) -> Path:
        """Which text-encoder/VAE file each checkpoint uses, remembered per checkpoint."""
        return self.data_dir / "part-choices.json"

    @property
    def default_checkpoint_file(self) -> Path:
        """The sessions' default checkpoint, loaded first at the next start (`app/ui/default_checkpoint.py`)."""
        return self.data_dir / "default-checkpoint.json"

    @property
    def lora_options_file(self) -> Path:
        """Per-LoRA choices (partial application allowed), remembered per LoRA name."""
        return self.data_dir / "lora-options.json"

    @property
    def outputs_dir(self) -> Path:
        return self.data_dir / "outputs"

    @property
    def styles_file(self) -> Path:
        """Saved prompt styles, A1111's `styles.csv` (app/styles.py)."""
        return self.data_dir / "styles.csv"

    @property
    def compile_cache_dir(self) -> Path:
        """torch.compile artifacts kept across restarts, so a warm start skips the minute-long compile."""
        return self.data_dir / "cache" / "torch-compile"

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)

    def public_dict(self) -> dict:
        """Settings safe to publish in a bug report: credentials are reduced to a count."""
        logins = ("auth", "api_auth", "admins")
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in logins}
        out["data_dir"] = str(self.data_dir)
        out["auth_users"] = len(self.auth)
        out["admins"] = len(self.admins)
        out["api_auth_users"] = len(self.api_auth)
        return out
