"""The device check: everything a lent GPU must show, in priority order, inside a time budget.

Why one command: a GPU is lent to about one task in five, for 15 minutes of device time in all,
starts included. The nine separate GPU commands of earlier notes did not fit, so nothing was
measured on a GPU for days. This runs the plan below in order, starts a section only when its
estimate fits in what is left of `--budget`, stops a section that runs past its cap (partial output
kept), and writes what each section measured plus a one-page `SUMMARY.md` and `devicecheck.json`.

    python -m app.devicecheck --budget 540            # on the GPU: results in benchmarks/results/<gpu>/
    python -m app.devicecheck --dry-run               # on the CPU: the same plan on tiny models

`--dry-run` walks the same plan on the CPU: the test section collects its tests with the packages the
device image lacks (Gradio and the web stack) made unimportable, and every bench section runs its
`--smoke` form (tiny models, same code paths). Estimates are device seconds on an H100, process
start included, from the runs recorded in `benchmarks/results/nvidia-h100-80gb-hbm3/devicecheck-*`
(2026-11-26: (b) 102 s, (c) 206 s, (d) 95 s, (e) 144 s; (a) was stopped at 271 s in a larger fast form than
today's; the families' offload sections' from the phases they reached before their caps);
each run writes its actual seconds beside them, and every log line carries its elapsed seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
# The -m gpu test files that run on the device image (torch, transformers, peft, accelerate, pytest,
# and carried diffusers; no Gradio): what they protect is in each file's docstring.
GPU_TEST_FILES = ("tests/test_engine.py", "tests/test_algos.py", "tests/test_lora_engine.py", "tests/test_memory.py",
                  "tests/test_gpu_sequences.py", "tests/test_gpu_workflows.py", "tests/test_fuzz.py")
DEVICE_LACKS = ("gradio", "gradio_client", "fastapi", "webuiapi", "playwright")  # made unimportable in --dry-run
CAP_FACTOR = 1.35  # a section may run this much past its estimate before it is stopped


@dataclass(frozen=True)
class Section:
    """One step of the plan: `bench` arguments for `python -m app.bench`, or a pytest run (`tests`)."""

    key: str
    letter: str
    title: str
    estimate_s: int  # device seconds on an H100, process start included
    bench: tuple[str, ...] = ()
    tests: bool = False
    dry_run_families: int = 0  # a dry run benches the first this many of its --families (0: all): same code, less CPU


    def command(self, out: Path, dry_run: bool) -> list[str]:
        if self.tests:
            return _pytest_command(out / f"{self.key}.xml", dry_run)
        args = list(self.bench)
        if dry_run:  # the smoke preset's rounds and steps: the same code paths, seconds on tiny models
            for flag in ("--repeats", "--steps"):
                if flag in args:
                    del args[args.index(flag):args.index(flag) + 2]
            args.insert(0, "--smoke")
            if self.dry_run_families and "--families" in args:
                at = args.index("--families") + 1
                args[at] = ",".join(args[at].split(",")[:self.dry_run_families])
        return [sys.executable, "-m", "app.bench", *args, "--out", str(out)]


def _family_sections() -> tuple[list[Section], list[Section]]:
    """Each benched family's own sections, as it states them (`TestKit.bench`): its headline rows, in
    `check_order`, and (later in the plan) its offload rows at the same steps."""
    benched = sorted((fam for fam in FAMILIES.values() if fam.test_kit.bench and fam.test_kit.bench.check),
                     key=lambda fam: fam.test_kit.bench.check_order)
    headline = [Section(fam.name, "", fam.test_kit.bench.check_title, fam.test_kit.bench.check_s,
                        ("--families", fam.name, *fam.test_kit.bench.check)) for fam in benched]
    offload = []
    for fam in (f for f in benched if f.test_kit.bench.offload_check_s):
        bench = fam.test_kit.bench
        steps = bench.check[bench.check.index("--steps"):][:2] if "--steps" in bench.check else ()
        offload.append(Section(f"{fam.name}-offload", "", f"{fam.label} {bench.side}²: every offload mode vs "
                               "diffusers' model, sequential and group offload", bench.offload_check_s,
                               ("--families", fam.name, "--sections", "offload", "--batches", "1", "--repeats", "2",
                                *steps)))
    return headline, offload


def _plan() -> tuple[Section, ...]:
    """The GPU tests, each family's headline rows, the sections that compare engine features across
    SD1.5 and SDXL, then each family's offload rows; lettered in that order."""
    headline, family_offload = _family_sections()
    controlled = [fam for fam in FAMILIES.values() if fam.test_kit.bench and fam.controlnet]  # with ControlNet rows
    # the benched families read from .gguf files (assembled from parts): GGUF rows (issue 40)
    packed = sorted((fam for fam in FAMILIES.values()
                     if fam.test_kit.bench and fam.test_kit.bench.check and fam.files.parts),
                    key=lambda fam: fam.test_kit.bench.check_order)
    sections = [
        Section("gpu-tests", "", "-m gpu correctness tests, fast form: placement repair, forced OOM, LoRA math on "
                "the weight's device, pinned backups, VRAM returned on switches, SD.Next sequences in every offload "
                "mode (full-size SD1.5 bf16, SDXL fp16), workflows (SD1.5 bf16), fp8 and offload fuzz", 245,
                tests=True),
        *headline,
        Section("step-cache", "", "first-block step cache (threshold 0.1) vs uncached ours, SD1.5 512² and FLUX.1-dev "
                "1024², 20 steps: speed, whole denoiser calls, PSNR (estimate not yet from a run)", 150,
                ("--families", "sd15,flux-dev", "--sections", "cache", "--batches", "1", "--repeats", "4", "--steps",
                 "20")),
        Section("controlnet", "", "one ControlNet unit, ours vs diffusers' ControlNet pipeline on the same weights, "
                f"{', '.join(f.label for f in controlled)} at their bench sides, 20 steps: it/s, per-image time, VRAM "
                "(estimate not yet from a run)", 90 * len(controlled),
                ("--families", ",".join(f.name for f in controlled), "--sections", "controlnet", "--batches", "1",
                 "--repeats", "4", "--steps", "20")),
        Section("compile", "", "compiled denoiser (reduce-overhead): speed vs eager, recompiles and CUDA-graph "
                "re-records across LoRA changes, SD1.5 then SDXL", 330,
                ("--families", "sd15,sdxl", "--sections", "compile", "--batches", "1", "--repeats", "2")),
        Section("offload", "", "every offload mode vs diffusers' model/sequential/group offload, SD1.5 and "
                "balanced under a 3 GiB budget", 200,
                ("--families", "sd15", "--sections", "offload", "--batches", "1", "--repeats", "2", "--steps", "10")),
        Section("channels-last", "", "channels_last on/off: SD1.5 512² and SDXL 1024², none and 3 fused LoRAs "
                "(decides the CUDA default)", 230,
                ("--families", "sd15,sdxl", "--sections", "throughput", "--batches", "1", "--loras", "0,3",
                 "--repeats", "2")),
        *family_offload,
        Section("gguf", "", f"GGUF Q8_0 and Q4_K, {', '.join(f.label for f in packed)}: ours from a transformer-only "
                ".gguf (original names) vs diffusers' GGUFQuantizationConfig on the same blocks and vs diffusers "
                "eager, 8 steps: it/s, per-image time, peak VRAM (estimate not yet from a run)", 240 * len(packed),
                ("--families", ",".join(f.name for f in packed), "--sections", "gguf", "--batches", "1",
                 "--loras", "0,3", "--repeats", "2", "--steps", "8"), dry_run_families=1),
    ]
    return tuple(dataclasses.replace(section, letter=string.ascii_lowercase[i]) for i, section in enumerate(sections))


PLAN = _plan()


def _pytest_command(junit: Path, dry_run: bool) -> list[str]:
    args = ["-o", "addopts=-ra", "-p", "no:cacheprovider", "-m", "gpu and not gpu_long", "--timeout", "400",
            f"--junitxml={junit}", "-v", *GPU_TEST_FILES]
    if not dry_run:
        return [sys.executable, "-m", "pytest", *args]
    # Collect with the device image's package set: a GPU test that imports Gradio would fail there.
    blocker = ";".join(f"sys.modules[{name!r}] = None" for name in DEVICE_LACKS)
    collect = args + ["--collect-only", "-q"]
    return [sys.executable, "-c", f"import sys; {blocker}; import pytest; sys.exit(pytest.main({collect!r}))"]


@dataclass
class Outcome:
    key: str
    letter: str
    title: str
    estimate_s: int
    status: str = "skipped"  # passed | failed | stopped at cap | skipped
    seconds: float | None = None
    reason: str = ""
    command: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)


def _run(command: list[str], log_path: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, float]:
    """Run `command` with each output line in `log_path` behind its elapsed seconds (so a section
    stopped at its cap still shows what took the time); stop its whole process group at `timeout_s`
    (rc None). A new session, so a stop also ends the workers a section started."""
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, errors="replace")
    stopped = threading.Event()
    timer = threading.Timer(timeout_s, _stop, (proc, stopped))
    timer.start()
    try:
        with log_path.open("w") as log:
            for line in proc.stdout:
                log.write(f"[{time.monotonic() - started:7.1f}s] {line}")
                log.flush()
        rc = proc.wait()
    finally:
        timer.cancel()
    return None if stopped.is_set() else rc, time.monotonic() - started


def _stop(proc: subprocess.Popen, stopped: threading.Event) -> None:
    stopped.set()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _test_figures(log_text: str) -> dict:
    """pytest's final counts ("3 passed, 1 failed, 2 skipped") and the failed test ids."""
    counts = {}
    for line in reversed(log_text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|tests? collected)", line)
        if found and ("==" in line or "collected" in line or " in " in line):
            counts = {kind: int(n) for n, kind in found}
            break
    if not counts:  # stopped at its cap: count the verbose per-test lines written so far
        for kind in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            if n := len(re.findall(rf"^\[ *[\d.]+s\] tests/\S+ {kind}", log_text, re.MULTILINE)):
                counts[kind.lower()] = n
    failed = re.findall(r"^\[ *[\d.]+s\] (?:FAILED|ERROR) (\S+)", log_text, re.MULTILINE)
    return {"counts": counts, "failed": failed[:20]}


def _bench_figures(out: Path, started: float) -> dict:
    """The acceptance checks and every comparison row of the bench files this section wrote."""
    figures: dict = {"files": [], "acceptance": [], "rows": []}
    for path in sorted(out.glob("*.json")):
        if path.stat().st_mtime < started or path.name == "devicecheck.json":
            continue
        doc = json.loads(path.read_text())
        figures["files"].append(path.name)
        figures["acceptance"] += doc.get("acceptance", [])
        figures["rows"] += [{k: r.get(k) for k in ("id", "ours_its", "baseline_its", "ratio", "verdict",
                                                   "ours_vram_peak_gib")} for r in doc.get("rows", [])]
        for family_name, model in doc.get("models", {}).items():
            for key in ("resting_vram_gib", "phase_errors"):
                if key in model:
                    figures.setdefault(key, {})[family_name] = model[key]
        figures["latency"] = [{k: r.get(k) for k in ("family", "op", "ours_ms", "baseline", "baseline_ms")}
                              for r in doc.get("latency", [])]
    return figures


def run_plan(sections: tuple[Section, ...], budget_s: float, out: Path, dry_run: bool) -> list[Outcome]:
    """Each section in order while the budget lasts; returns what each did."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", SD_GPU_FAST="1", HF_HUB_OFFLINE="1")
    begun, outcomes = time.monotonic(), []
    for section in sections:
        outcome = Outcome(section.key, section.letter, section.title, section.estimate_s)
        outcomes.append(outcome)
        left = budget_s - (time.monotonic() - begun)
        if not dry_run and section.estimate_s > left:
            outcome.reason = f"estimate {section.estimate_s} s > {left:.0f} s left of the budget"
            continue
        outcome.command = section.command(out, dry_run)
        print(f"[devicecheck] ({section.letter}) {section.key}: {' '.join(outcome.command[-12:])}", flush=True)
        started = time.time()
        cap = left if dry_run else min(left, section.estimate_s * CAP_FACTOR)
        rc, outcome.seconds = _run(outcome.command, out / f"{section.key}.log", env, max(cap, 30))
        outcome.status = "stopped at cap" if rc is None else "passed" if rc == 0 else "failed"
        if rc is None:
            outcome.reason = f"stopped after {cap:.0f} s (estimate {section.estimate_s} s × {CAP_FACTOR})"
        log_text = (out / f"{section.key}.log").read_text(errors="replace")
        outcome.figures = _test_figures(log_text) if section.tests else _bench_figures(out, started)
        if rc not in (None, 0):
            outcome.reason = log_text.strip().splitlines()[-1][:300] if log_text.strip() else f"exit {rc}"
        print(f"[devicecheck] ({section.letter}) {section.key}: {outcome.status} in {outcome.seconds:.0f} s",
              flush=True)
    return outcomes


# ------------------------------------------------------------------------------------ summary
def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _figure_lines(outcome: Outcome) -> list[str]:
    figs = outcome.figures
    if "counts" in figs:
        lines = [f"- tests: {', '.join(f'{n} {k}' for k, n in figs['counts'].items()) or 'no summary line'}"]
        return lines + [f"- failed: `{test}`" for test in figs["failed"]]
    lines = [f"- {c['check']} ({c['where']}): {_fmt(c['value'])} (target {c['target']}, "
             f"{'passed' if c['passed'] else 'missed' if c['passed'] is False else 'no value'})"
             for c in figs.get("acceptance", [])]
    lines += [f"- {r['id']}: {_fmt(r['ours_its'])} vs {_fmt(r['baseline_its'])} it/s, ratio {_fmt(r['ratio'])} "
              f"({r['verdict']}), peak VRAM {_fmt(r['ours_vram_peak_gib'])} GiB" for r in figs.get("rows", [])]
    lines += [f"- {r['family']} LoRA {r['op']}: {_fmt(r['ours_ms'])} ms (baseline {r['baseline']}: "
              f"{_fmt(r['baseline_ms'])} ms)" for r in figs.get("latency", [])]
    lines += [f"- {family_name} weights at rest: " + ", ".join(f"{k} {_fmt(v)} GiB" for k, v in rest.items())
              for family_name, rest in figs.get("resting_vram_gib", {}).items()]
    lines += [f"- {family_name} phase failed: {phase}: {error}"
              for family_name, errors in figs.get("phase_errors", {}).items() for phase, error in errors.items()]
    return lines + ([f"- files: {', '.join(figs['files'])}"] if figs.get("files") else [])


def summary(outcomes: list[Outcome], env: dict, budget_s: float, dry_run: bool) -> str:
    """The one page a reviewer reads first: what ran, how long against its estimate, what it showed."""
    spent = sum(o.seconds or 0 for o in outcomes)
    lines = [f"# Device check{' (dry run on the CPU: tiny models, numbers mean nothing)' if dry_run else ''}", "",
             f"{env['created']} · {env['device']} · torch {env['torch']} · diffusers {env['diffusers']} · "
             f"budget {budget_s:.0f} s, spent {spent:.0f} s", "",
             "| | section | estimate s | actual s | status | note |", "|---|---|---|---|---|---|"]
    lines += [f"| {o.letter} | {o.key} | {o.estimate_s} | {_fmt(o.seconds)} | {o.status} | {o.reason} |"
              for o in outcomes]
    for o in outcomes:
        lines += ["", f"## ({o.letter}) {o.key}: {o.status}", "", o.title, ""] + _figure_lines(o)
    return "\n".join(lines) + "\n"


def _environment() -> dict:
    import diffusers
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": gpu,
            "slug": re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-"), "torch": torch.__version__,
            "diffusers": diffusers.__version__, "cuda": torch.version.cuda}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.devicecheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=540, help="device seconds this run may take (default 540)")
    parser.add_argument("--dry-run", action="store_true", help="walk the plan on the CPU with tiny models")
    parser.add_argument("--only", help=f"comma list of sections ({','.join(s.key for s in PLAN)})")
    parser.add_argument("--out", type=Path,
                        help="output folder (default benchmarks/results/<gpu>/; dry run: a temp one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = set(args.only.split(",")) if args.only else {s.key for s in PLAN}
    unknown = wanted - {s.key for s in PLAN}
    if unknown:
        print(f"--only: unknown sections {sorted(unknown)}; choose from {[s.key for s in PLAN]}", file=sys.stderr)
        return 2
    sections = tuple(s for s in PLAN if s.key in wanted)
    env = _environment()
    if not args.dry_run and env["device"] == "cpu":
        print("error: the device check needs a CUDA GPU; on this machine run it with --dry-run", file=sys.stderr)
        return 2
    for s in sections:
        print(f"({s.letter}) {s.key:14} ~{s.estimate_s:4d} s on an H100  {s.title}")
    first_three = sum(s.estimate_s for s in PLAN if s.letter in "abc")
    print(f"sections (a)-(c): ~{first_three} s of a {args.budget:.0f} s budget", flush=True)
    out = args.out or (Path(tempfile.mkdtemp(prefix="devicecheck-")) if args.dry_run else RESULTS_DIR / env["slug"])
    outcomes = run_plan(sections, args.budget, out, args.dry_run)
    (out / "devicecheck.json").write_text(json.dumps({"env": env, "budget_s": args.budget, "dry_run": args.dry_run,
                                                      "sections": [asdict(o) for o in outcomes]}, indent=2) + "\n")
    (out / "SUMMARY.md").write_text(summary(outcomes, env, args.budget, args.dry_run))
    print(out / "SUMMARY.md")
    return 0 if all(o.status in ("passed", "skipped") for o in outcomes) else 1
