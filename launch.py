"""Steady Diffusion launcher: command-line flags -> Settings -> Engine -> UI.

`python launch.py` serves the UI on 127.0.0.1:7860. With an empty models folder it first writes
tiny random-weight demo models so a newcomer sees a working app at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("NO_PROXY", "localhost,127.0.0.1")

from app.console import quiet_third_party  # noqa: E402
from app.logins import add_login_flags, login_settings  # noqa: E402
from app.settings import DTYPE_CHOICES, OFFLOAD_CHOICES, WEIGHTS_CHOICES, Settings  # noqa: E402
from app.torch_pair import pair_problem  # noqa: E402

log = logging.getLogger("steady_diffusion")


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" only where the default says something (not None, False or an empty
    list) and the help text does not state its default already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--data-dir", default=".", help="folder with models/Stable-diffusion, models/Lora, "
                   "embeddings and outputs (an A1111 install folder works as is); must exist")
    p.add_argument("--create-data-dir", action="store_true", help="create --data-dir when it does not exist")
    p.add_argument("--model", default=None, help="checkpoint name to load at start (default: the first found)")
    p.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:1 …")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="one engine per device, each job sent to the one holding its model and LoRAs: "
                        "cuda:0,cuda:1 (or all: every GPU; cpu,cpu for tests); replaces --device")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights dtype; auto = bf16 on GPUs that support it, else fp16 on CUDA, fp32 on CPU")
    p.add_argument("--offload", default="none", choices=OFFLOAD_CHOICES, help="offload mode at start")
    p.add_argument("--weights", default="full", choices=WEIGHTS_CHOICES,
                   help="fp8: store the large weights in 8 bits (about half the memory), computed in --dtype; "
                        "LoRAs then apply as exact bypass forwards. fp8-compute: the same, and the Linear layers "
                        "that qualify run as fp8 matmuls (GPUs with compute capability 8.9+, or the CPU). "
                        "int8: the large weights rest as int8 with a scale per output row (quantised on load "
                        "from a bf16/fp16 file), computed in --dtype; LoRAs as exact bypass forwards")
    p.add_argument("--lora-backups", default="gpu", choices=("cpu", "gpu"),
                   help="where fused LoRAs keep the original weights (for exact undo): gpu = on the GPU while "
                        "2 GiB stay free, else pinned host memory (default: a slider move copies nothing over "
                        "PCIe); cpu = pinned host memory, no VRAM cost, each re-weight copies the originals over")
    p.add_argument("--vram-budget", type=float, default=None, metavar="GIB",
                   help="cap on GPU memory for balanced offload (simulate a smaller GPU)")
    p.add_argument("--vram-watermark", type=float, default=Settings.balanced_watermark, metavar="FRACTION",
                   help="balanced offload keeps components resident up to this fraction of the GPU's memory")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the UNet (first compile ~1 min, cached across restarts; offload none only)")
    p.add_argument("--channels-last", action="store_true",
                   help="keep UNet and VAE convolution weights channels_last (NHWC): saves cuDNN's per-call layout "
                        "conversion; off by default until GPU benchmarks confirm the gain")
    p.add_argument("--compile-mode", default="reduce-overhead", choices=("reduce-overhead", "default"),
                   help="reduce-overhead uses CUDA graphs (fastest); default compiles without them")
    p.add_argument("--compile-whole", action="store_true",
                   help="compile the whole denoiser even for DiTs, which by default compile each repeated block "
                        "class once (a much shorter first compile, no CUDA graphs)")
    p.add_argument("--strict", action="store_true", help="treat any placement violation as an error")
    p.add_argument("--strict-forwards", action="store_true",
                   help="check in every module's forward that its tensors are on the compute device in the compute "
                        "dtype (debug; slower)")
    p.add_argument("--lora-debug", action="store_true", help="log LoRA key matching (also SD_LORA_DEBUG=1)")
    p.add_argument("--move-debug", action="store_true", help="log every tensor move (also SD_MOVE_DEBUG=1)")
    p.add_argument("--slider-range", nargs=2, type=float, default=(-2.0, 2.0), metavar=("MIN", "MAX"),
                   help="range of the LoRA weight sliders; the API accepts any finite weight (default: -2 2)")
    p.add_argument("--no-demo", action="store_true", help="do not create demo models when none are found")
    p.add_argument("--listen", action="store_true", help="serve on 0.0.0.0 instead of 127.0.0.1")
    p.add_argument("--port", type=int, default=7860, help="HTTP port")
    p.add_argument("--share", action="store_true", help="create a public Gradio share link")
    add_login_flags(p)
    p.add_argument("--forwarded-allow-ips", action="append", default=[], metavar="IP[,IP]",
                   help="reverse proxies trusted to name the client in X-Forwarded-For (for the login throttle); "
                        "default: none, the connection's own address counts")
    p.add_argument("--queue-size", type=int, default=Settings.queue_size,
                   help="requests that may wait in the queue, all users together")
    p.add_argument("--session-queue-size", type=int, default=Settings.session_queue_size,
                   help="requests one browser tab or gradio_client session may have pending, of any kind")
    p.add_argument("--account-queue-size", type=int, default=Settings.account_queue_size,
                   help="jobs one login may have waiting or running, the UI's and the A1111 API's together "
                        "(with no login, everyone is one account, bounded by --queue-size); logins take turns")
    p.add_argument("--max-upload-mib", type=int, default=Settings.max_upload_mib,
                   help="largest upload accepted: one request, all its files together")
    p.add_argument("--max-upload-files", type=int, default=Settings.max_upload_files,
                   help="most files one upload request may carry")
    p.add_argument("--account-upload-quota-mib", type=int, default=Settings.account_upload_quota_mib,
                   help="uploaded temporary files one login may hold on disk; a file is removed when the job "
                        "that used it ends, or an hour after its upload if none does")
    p.add_argument("--memory-budget-gib", type=float, default=None, metavar="GIB",
                   help="memory one job may plan to use (its estimate: decode, upscale, prompt chunks, kept images) "
                        "on top of the models; a job over it is refused before it starts. Default: a quarter of the "
                        "RAM, and on a GPU half of its memory for what runs there")
    p.add_argument("--png-compression", type=int, default=Settings.png_compress_level, metavar="0-9",
                   help="zlib level of saved PNGs: 1 writes fastest, 9 smallest; the default 4 costs ~1%% in size "
                        "against PIL's 6 and writes a 1024² image ~2.5x faster")
    p.add_argument("--lora-cache-mib", type=int, default=Settings.lora_cache_mib,
                   help="LoRA files kept in RAM after reading (0 = read from disk every time)")
    p.add_argument("--bug-report", nargs="?", const="bug-report.zip", default=None, metavar="ZIP",
                   help="write a bug-report bundle and exit (works when the UI cannot start)")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(
        data_dir=Path(args.data_dir), device=args.device, dtype=args.dtype,
        devices=tuple(d.strip() for d in args.devices.split(",")) if args.devices else (),
        offload=args.offload, weights=args.weights,
        lora_backups=args.lora_backups, png_compress_level=args.png_compression,
        vram_budget_gib=args.vram_budget, balanced_watermark=args.vram_watermark,
        compile=args.compile, compile_mode=args.compile_mode, compile_whole=args.compile_whole,
        channels_last=args.channels_last,
        strict=args.strict, strict_forwards=args.strict_forwards,
        lora_debug=args.lora_debug or Settings().lora_debug, move_debug=args.move_debug or Settings().move_debug,
        slider_min=min(args.slider_range), slider_max=max(args.slider_range),
        listen=args.listen, port=args.port, share=args.share,
        **login_settings(args),
        forwarded_allow_ips=tuple(ip.strip() for arg in args.forwarded_allow_ips for ip in arg.split(",")
                                  if ip.strip()),
        queue_size=args.queue_size, session_queue_size=args.session_queue_size,
        account_queue_size=args.account_queue_size,
        max_upload_mib=args.max_upload_mib, max_upload_files=args.max_upload_files,
        account_upload_quota_mib=args.account_upload_quota_mib, lora_cache_mib=args.lora_cache_mib,
        memory_budget_gib=args.memory_budget_gib,
    )


def check_data_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A mistyped --data-dir must not silently become a new, empty install (with demo models in it)."""
    folder = Path(args.data_dir).expanduser()
    if folder.is_dir():
        return
    if folder.exists():
        parser.error(f"--data-dir {folder} is a file, not a folder")
    if not args.create_data_dir:
        parser.error(f"--data-dir {folder} does not exist; check the path, or add --create-data-dir to start "
                     "a new data folder there")
    folder.mkdir(parents=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_data_dir(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_third_party()
    try:
        settings = settings_from_args(args)
    except ValueError as exc:  # a value no Settings takes: one line naming it, not a traceback
        parser.error(str(exc))
    if args.bug_report:
        from app.report import write_bug_report_offline

        path = write_bug_report_offline(settings, Path(args.bug_report))
        print(f"bug report written to {path}")
        return 0
    problem = pair_problem()
    if problem:  # one line naming the pair to install, not spandrel's traceback later
        print(f"launch.py: {problem}", file=sys.stderr)
        return 1
    from app.ui.serve import serve

    return serve(settings, initial_model=args.model, create_demo=not args.no_demo)


if __name__ == "__main__":
    sys.exit(main())
