"""The CPU proxies' results as Markdown (the JSON is the results document itself)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.report import table


def _estimate(value: dict[str, Any] | None, digits: int = 2) -> str:
    if value is None:
        return "–"
    return f"{value['median']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]"


def _interval(pair: list[float] | None) -> str:
    return "–" if pair is None else f"[{pair[0]:.3f}, {pair[1]:.3f}]"


def _ratio(row: dict[str, Any]) -> str:
    return "–" if row["ratio"] is None else f"{row['ratio']:.3f}× {_interval(row['ratio_interval'])}"


def _comparison_rows(sections: list[dict[str, Any]]) -> list[list[str]]:
    return [[s["arch"], row["ours"], row["baseline"], row["figure"], _estimate(row["ours_median"]),
             _estimate(row["baseline_median"]), _ratio(row), _interval(row["control_spread"]), row["verdict"]]
            for s in sections if "skipped" not in s for row in s["comparisons"]]


def _skipped(sections: list[dict[str, Any]], what: str) -> list[str]:
    return [f"- {what} {s['arch']}: skipped, {s['skipped']}" for s in sections if "skipped" in s]


HEADER = ["arch", "ours", "baseline", "figure", "ours", "baseline", "ratio [95%]", "control spread", "verdict"]


def _load(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## Load (a fresh process per load, {cfg['storage_dtype']} single file, page cache warm)", ""]
    return lines + table(HEADER, _comparison_rows(results["load"]))


def _ops_table(sections: list[dict[str, Any]]) -> list[str]:
    """Ops per call and distinct ops per variant; where the list differs from ours without LoRA, the
    ops that differ as [ours no LoRA, this variant] per call."""
    return table(["arch", "variant", "ops per call", "distinct ops", "same op list as ours no LoRA"],
                 [[s["arch"], variant, f"{o['total_per_call']:.0f}", o["distinct"],
                   "yes" if o["same_as_ours_no_lora"] else f"no: {json.dumps(o['differences'])[:400]}"]
                  for s in sections if "skipped" not in s for variant, o in s["ops"].items()])


def _step(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## Denoising step ({cfg['step_dtype']}, {cfg['resolution']}² px, {cfg['steps']} steps, CFG)", "",
             "aten ops per UNet call, counted by a dispatch mode inside the UNet's hooks:", ""]
    return lines + _ops_table(results["step"]) + table(HEADER, _comparison_rows(results["step"]))


def _ops(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## aten ops per denoiser call (meta device, full-size {cfg['storage_dtype']} models, batch 1)", ""]
    lines += [f"- {s['arch']}: {s['denoiser']} ({s['params_b']:.2f} B parameters) at {s['resolution']}² px "
              f"({s['latent_side']}² latent); three rank-{cfg['lora_rank']} LoRAs on {s['layers_touched']} layers, "
              "applied by our LoraStack (fused in place; then as `lora.bypass` hooks; then removed)"
              for s in results["ops"]]
    return lines + [""] + _ops_table(results["ops"])


def _reweight(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## LoRA add / re-weight / remove (the third of three rank-{cfg['lora_rank']} LoRAs, a LoCon)", "",
             "ms: the engine's whole transition, and the patching alone (median [95%]); then one counted change "
             "each: host syncs, walks over every tensor, aten ops (~ kernel launches on a GPU), layers written, "
             "originals read from backups (what a GPU copies over PCIe per change with `--lora-backups cpu`) and "
             "bytes that crossed between devices here.", ""]
    rows = []
    for r in (r for r in results["reweight"] if "skipped" not in r):
        for op in ("add", "reweight", "remove"):
            c = r["costs"][op]
            rows.append([r["arch"], r["dtype"], op, _estimate(r["ms"][op], 0), _estimate(r["patch_ms"][op], 0),
                         c["host_syncs"], c["tensor_walks"], c["aten_ops"], c["layers_written"],
                         f"{c['backup_bytes_read'] / 2**20:.1f}", f"{c['bytes_across'] / 2**20:.1f}"])
    return lines + table(["arch", "dtype", "change", "ms (whole)", "of which patching ms", "host syncs",
                          "tensor walks", "aten ops", "layers written", "originals read MiB",
                          "MiB across devices"], rows)


def _fp8(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## fp8 weight storage ({cfg['step_dtype']} compute, {cfg['resolution']}² px, three LoRAs as bypasses "
             "or fused into compute-dtype copies of the touched layers)", ""]
    measured = [s for s in results["fp8"] if "skipped" not in s]
    lines += table(["arch", "resting GiB, all weights in the compute dtype", "resting GiB, fp8",
                    "resting GiB, fp8 + fused copies", "ratio fp8 / full", "layers in fp8", "layers copied",
                    "copies built ms", "pixels bypass vs fused: max / mean"],
                   [[s["arch"], f"{s['resting_gib']['full']:.2f}", f"{s['resting_gib']['fp8']:.2f}",
                     f"{s['resting_gib']['fp8 + fused copies']:.2f}", f"{s['resting_ratio']:.2f}×", s["stored_layers"],
                     s["fused_copies"]["layers"], f"{s['fused_copies']['build_ms']:.0f}",
                     f"{s['bypass_vs_fused_pixels']['max']} / {s['bypass_vs_fused_pixels']['mean']:.3f}"]
                    for s in measured])
    return lines + table(HEADER, _comparison_rows(results["fp8"]))


# (results key, section, what a skip note calls it): a section is drawn only when it was measured.
SECTIONS = (("load", _load, "load"), ("step", _step, "step"), ("reweight", _reweight, "re-weight"),
            ("fp8", _fp8, "fp8"), ("ops", _ops, "ops"))


def render(results: dict[str, Any]) -> str:
    env, cfg = results["env"], results["config"]
    lines = [f"# CPU proxies: Steady Diffusion vs diffusers ({env['created']})", "",
             f"torch {env['torch']} · diffusers {env['diffusers']} · {env['cpu']} · {cfg['threads']} intra-op "
             f"thread(s) in-process, 2 per load probe · full-size architectures, random weights", "",
             f"Statistics: {results['method']}. Variants run in ABBA order over {cfg['rounds']} rounds; a ratio is "
             "ours relative to the baseline, > 1 means ours is better (speed ours/baseline, time and memory "
             "baseline/ours), from the per-round pairs. The control is the same configuration measured as a second "
             "variant; a ratio inside the control's spread reads \"no difference\".", ""]
    notes = []
    for key, section, what in SECTIONS:
        if any("skipped" not in s for s in results.get(key, [])):
            lines += section(results, cfg)
        notes += _skipped(results.get(key, []), what)
    notes += [f"- step {s['arch']}: {note}" for s in results.get("step", []) if "skipped" not in s
              for note in (s["fused_note"], s["baseline_note"]) if note]
    return "\n".join(lines + (["## Not measured, or measured otherwise", "", *notes, ""] if notes else []))


def write(results: dict[str, Any], out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    paths["md"].write_text(render(results) + "\n")
    return paths
