"""The benchmark (`python -m app.bench`, implemented in `benchmarks/bench.py`).

A GPU run takes minutes on an H100 and cannot run here, so the CPU smoke mode runs the very same
code on tiny models and these tests check what a GPU run will write: the JSON schema (medians,
ratios, per-row peak VRAM fields, TFLOP per step, acceptance), the Markdown table and the PNG chart.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from PIL import Image

from app import bench as app_bench

ROW_KEYS = {
    "id", "section", "arch", "resolution", "batch", "steps", "offload", "loras", "ours", "baseline",
    "tflop_per_step", "ratio", "note",
    *(f"{side}_{field}" for side in ("ours", "baseline")
      for field in ("its", "its_runs", "gen_s", "peak_vram_torch_gib", "peak_vram_nvml_gib", "peak_fraction")),
}


@pytest.fixture(scope="module")
def bench():
    return app_bench.load()


@pytest.fixture(scope="module")
def smoke(bench, tmp_path_factory):
    """One smoke run (SD1.5 only, to keep the test short; SDXL takes the same code paths)."""
    out = tmp_path_factory.mktemp("bench")
    assert app_bench.main(["--smoke", "--archs", "sd15", "--out", str(out)]) == 0
    return out, json.loads((out / "smoke-sd15.json").read_text())


def test_smoke_run_writes_json_markdown_and_chart(smoke):
    """One run writes <stem>.json, a Markdown table with the ratio column and a PNG bar chart."""
    out, results = smoke
    assert results["schema"] == "steady-diffusion-bench/1" and results["mode"] == "smoke"
    markdown = (out / "smoke-sd15.md").read_text()
    assert "| ratio |" in markdown and "## Acceptance" in markdown and "Smoke run" in markdown
    with Image.open(out / "smoke-sd15.png") as chart:
        assert chart.format == "PNG" and chart.width > 400 and chart.height > 100


def test_every_section_has_rows_with_medians_and_ratios(smoke):
    """Rows pair ours with a baseline: median it/s of the repeats, ratio = ours/baseline, or no ratio
    and a reason when the baseline cannot run (no peft / no CUDA here)."""
    _out, results = smoke
    rows = results["rows"]
    assert {r["section"] for r in rows} == {"throughput", "offload", "compile"}
    assert {r["offload"] for r in rows} == {"none", "model", "balanced", "balanced-3gib", "sequential", "group"}
    assert {r["loras"] for r in rows} == {0, 1, 3}
    repeats = results["config"]["repeats"]
    for row in rows:
        assert ROW_KEYS <= row.keys(), row["id"]
        assert len(row["ours_its_runs"]) == repeats and row["ours_its"] > 0
        assert row["ours_its"] == pytest.approx(statistics.median(row["ours_its_runs"]))
        if row["baseline_its"] is None:
            assert row["ratio"] is None and row["note"], row["id"]
        else:
            assert row["ratio"] == pytest.approx(row["ours_its"] / row["baseline_its"])
    assert any(r["ratio"] is not None and r["baseline"] == "diffusers" for r in rows)
    # Ratios between our own configurations come from round-robin repeats, so both sides exist.
    for row in rows:
        if row["baseline"] in ("ours no LoRA", "ours offload none"):
            assert len(row["baseline_its_runs"]) == repeats, row["id"]


def test_rows_record_peak_vram_fields_and_the_physical_limit(smoke):
    """Every row carries torch and NVML peak VRAM (None on the CPU) and UNet TFLOP per step; the
    fraction of the bf16 peak is None without a known GPU peak."""
    _out, results = smoke
    assert results["models"]["sd15"]["tflop_per_step"]["1"] > 0
    for row in results["rows"]:
        assert row["tflop_per_step"] > 0
        assert row["ours_peak_vram_torch_gib"] is None and row["ours_peak_vram_nvml_gib"] is None
        assert row["ours_peak_fraction"] is None
    assert results["env"]["peak_bf16_tflops"] is None and results["env"]["gpu_slug"] == "cpu"


def test_latency_load_compile_and_acceptance(smoke):
    """LoRA add/re-weight/remove latency and load time are medians in ms/s; the compiled path reports
    zero recompiles across LoRA changes that all reached the output; acceptance lists each target."""
    _out, results = smoke
    assert {r["op"] for r in results["latency"]} == {"add", "reweight", "remove"}
    assert all(r["ours_ms"] > 0 for r in results["latency"])
    assert all(0 < r["ours_patch_ms"] < r["ours_ms"] for r in results["latency"])
    (load,) = results["load"]
    assert load["ours_s"] > 0 and load["baseline_s"] > 0 and load["ratio"] > 0
    (info,) = results["compile"]
    assert info["compiles_after_warm"] >= 1 and info["recompiles_during_lora_ops"] == 0
    assert info["lora_changes_reached_output"] is True and info["first_compile_s"] > 0
    checks = {c["check"] for c in results["acceptance"]}
    assert {"ours no LoRA vs diffusers", "compiled vs diffusers eager", "ours LoRA re-weight latency (ms)",
            "recompiles + CUDA-graph re-records across LoRA changes"} <= checks
    assert all(c["passed"] in (True, False, None) for c in results["acceptance"])


def test_unet_flops_match_the_full_size_architecture(bench):
    """FLOPs are counted on a meta-device copy, so the full SD1.5 UNet costs no memory here: ~1.6
    TFLOP per CFG step at 512², four times that at batch 4."""
    from diffusers import UNet2DConditionModel

    from app.families import family

    config = UNet2DConditionModel.load_config(family("sd15").config_dir / "unet")
    one = bench.unet_tflop_per_step(config, 1, 64)
    assert 1.3 < one < 1.9
    assert bench.unet_tflop_per_step(config, 4, 64) == pytest.approx(4 * one, rel=0.01)


def test_gpu_names_map_to_result_folders_and_peaks(bench):
    """Results go to benchmarks/results/<gpu slug>/; the specific H100 variants win over the generic one."""
    assert bench.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.5
    assert bench.peak_tflops("Some Unknown GPU") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without a GPU")
def test_full_and_quick_modes_need_cuda(capsys):
    """Without CUDA the GPU modes stop at once with a clear message instead of running for minutes."""
    assert app_bench.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_app_bench_runs_the_one_implementation(bench):
    """`python -m app.bench` is a thin loader of benchmarks/bench.py, not a copy."""
    assert bench.__file__ == str(app_bench.BENCH_PATH) and app_bench.load() is bench
    with pytest.raises(SystemExit, match="sd15, sdxl"):
        bench.config_from_args(bench.parse_args(["--archs", "sd3"]))
