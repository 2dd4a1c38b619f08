"""The device check (`python -m app.devicecheck`): the one command a lent GPU runs.

A GPU is lent for minutes, so what protects it is tested here on the CPU: the dry run walks the
very plan a GPU runs (its GPU tests collected with the device image's packages, every bench section
on tiny models), the plan's first three sections fit the 540 s the issue budgets, a section is
never started past the budget, and one that overruns its cap is stopped with its output kept.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import devicecheck

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("devicecheck")
    proc = subprocess.run([sys.executable, "-m", "app.devicecheck", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    return proc, out


def test_dry_run_walks_every_section_and_lists_its_estimate(dry_run):
    """Every section of the plan runs on the CPU and passes; the console and SUMMARY.md list each
    with its estimated device seconds, and devicecheck.json records what each did."""
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for section in devicecheck.PLAN:
        assert re.search(rf"\({section.letter}\) {section.key} +~ *{section.estimate_s} s", proc.stdout)
    summary = (out / "SUMMARY.md").read_text()
    record = json.loads((out / "devicecheck.json").read_text())
    assert record["dry_run"] and [s["key"] for s in record["sections"]] == [s.key for s in devicecheck.PLAN]
    for section in record["sections"]:
        assert section["status"] == "passed", section
        assert f"| {section['letter']} | {section['key']} | {section['estimate_s']} |" in summary


def test_dry_run_collects_the_gpu_tests_without_the_web_stack(dry_run):
    """Section (a) collects its `-m gpu` tests with Gradio, FastAPI, webuiapi and Playwright made
    unimportable, as on the device image (which has none of them): a GPU test that imported one would
    fail there before it ran."""
    _proc, out = dry_run
    log = (out / "gpu-tests.log").read_text()
    collected = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", log)
    assert collected, log[-2000:]
    selected = int(collected.group(1))
    assert selected >= 15, log[-2000:]
    assert "test_fuzz_engine_api_gpu" in log and "test_flux_full_size" not in log  # gpu_long stays out


def test_dry_run_bench_sections_write_the_flux_fp8_rows(dry_run):
    """Section (c) writes Flux rows for bf16 against FluxPipeline and for fp8 storage with and
    without LoRA bypasses, and the resting-VRAM record (None on the CPU)."""
    _proc, out = dry_run
    flux = json.loads((out / "smoke-flux-dev-throughput_fp8.json").read_text())
    labels = {(r["ours"], r["baseline"]) for r in flux["rows"]}
    assert {("ours", "diffusers"), ("ours fp8", "diffusers"), ("ours fp8 + 3 LoRAs bypass", "ours fp8")} <= labels
    assert set(flux["models"]["flux-dev"]["resting_vram_gib"]) == {"ours full weights", "ours fp8 weights"}


@pytest.mark.parametrize("family_name", ["qwen-image-2.1", "krea-2"])
def test_dry_run_writes_qwen_image_21_and_krea_2_rows_against_their_pipelines(dry_run, family_name):
    """Qwen-Image 2.1's and Krea 2's sections (f, g: headline; o, p: offload) compare ours with diffusers' own
    pipeline (`QwenImage21Pipeline`, `Krea2Pipeline`) on the same weights: it/s and per-image seconds both sides
    with 0 and 3 LoRAs, fp8 storage, and every offload mode against diffusers' model, sequential and group offload;
    the resting-VRAM record is there (None on the CPU)."""
    from app.families import family

    _proc, out = dry_run
    assert family(family_name).plain_pipeline_class.__name__ == {"qwen-image-2.1": "QwenImage21Pipeline",
                                                                  "krea-2": "Krea2Pipeline"}[family_name]
    headline = json.loads((out / f"smoke-{family_name}-throughput_fp8.json").read_text())
    rows = {(r["section"], r["ours"], r["baseline"], r["loras"]): r for r in headline["rows"]}
    for key in (("throughput", "ours", "diffusers", 0), ("throughput", "ours fused", "diffusers PEFT fused", 3)):
        assert rows[key]["ours_its"] > 0 and rows[key]["ours_gen_s"] > 0 and rows[key]["baseline_gen_s"] > 0, key
    assert {("fp8", "ours fp8", "diffusers"), ("fp8", "ours fp8 + 3 LoRAs bypass", "ours fp8")} <= {k[:3] for k in rows}
    assert set(headline["models"][family_name]["resting_vram_gib"]) == {"ours full weights", "ours fp8 weights"}
    offload = json.loads((out / f"smoke-{family_name}-offload.json").read_text())
    assert {f"diffusers {mode} offload" for mode in ("model", "sequential", "group")} <= {
        r["baseline"] for r in offload["rows"]}


def test_the_first_three_sections_fit_the_issue_budget():
    """Priority (a)-(c) — GPU tests, SD1.5 against diffusers, Flux bf16/fp8 — sum to at most 540 s."""
    assert [s.letter for s in devicecheck.PLAN] == list("abcdefghijklmnopq")
    assert sum(s.estimate_s for s in devicecheck.PLAN[:3]) <= 540


def test_no_section_starts_past_the_budget(tmp_path):
    """With too little budget left, a section is skipped with the reason, and nothing is run."""
    outcomes = devicecheck.run_plan(devicecheck.PLAN, budget_s=60, out=tmp_path, dry_run=False)
    assert [o.status for o in outcomes] == ["skipped"] * len(devicecheck.PLAN)
    assert all("left of the budget" in o.reason and not o.command for o in outcomes)
    assert not list(tmp_path.glob("*.log"))


def test_a_section_past_its_cap_is_stopped_with_its_output_kept(tmp_path):
    """A command still running at its cap is stopped (rc None) within seconds, and what it printed
    stays in the log, each line behind its elapsed seconds."""
    started = time.monotonic()
    script = "import time; print('first line', flush=True); time.sleep(60)"
    rc, seconds = devicecheck._run([sys.executable, "-c", script], tmp_path / "x.log", {}, timeout_s=2)
    assert rc is None and 2 <= seconds < 20 and time.monotonic() - started < 20
    assert re.fullmatch(r"\[ +[\d.]+s\] first line\n", (tmp_path / "x.log").read_text())
