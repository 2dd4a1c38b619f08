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
    return [[s["family"], row["ours"], row["baseline"], row["figure"], _estimate(row["ours_median"]),
             _estimate(row["baseline_median"]), _ratio(row), _interval(row["control_spread"]), row["verdict"]]
            for s in sections if "skipped" not in s for row in s["comparisons"]]


def _skipped(sections: list[dict[str, Any]], what: str) -> list[str]:
    return [f"- {what} {s['family']}: skipped, {s['skipped']}" for s in sections if "skipped" in s]


HEADER = ["family", "ours", "baseline", "figure", "ours", "baseline", "ratio [95%]", "control spread", "verdict"]


def _load(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## Load (a fresh process per load, {cfg['storage_dtype']} single file, page cache warm)", ""]
    return lines + table(HEADER, _comparison_rows(results["load"]))


def _ops_table(sections: list[dict[str, Any]]) -> list[str]:
    """Ops per call and distinct ops per variant; where the list differs from ours without LoRA, the
    ops that differ as [ours no LoRA, this variant] per call."""
    return table(["family", "variant", "ops per call", "distinct ops", "same op list as ours no LoRA"],
                 [[s["family"], variant, f"{o['total_per_call']:.0f}", o["distinct"],
                   "yes" if o["same_as_ours_no_lora"] else f"no: {json.dumps(o['differences'])[:400]}"]
                  for s in sections if "skipped" not in s for variant, o in s["ops"].items()])


def _step(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## Denoising step ({cfg['step_dtype']}, {cfg['resolution']}² px, {cfg['steps']} steps, CFG)", "",
             "aten ops per UNet call, counted by a dispatch mode inside the UNet's hooks:", ""]
    return lines + _ops_table(results["step"]) + table(HEADER, _comparison_rows(results["step"]))


def _ops(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## aten ops per denoiser call (meta device, full-size {cfg['storage_dtype']} models, batch 1)", ""]
    lines += [f"- {s['family']}: {s['denoiser']} ({s['params_b']:.2f} B parameters) at {s['resolution']}² px "
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
            rows.append([r["family"], r["dtype"], op, _estimate(r["ms"][op], 0), _estimate(r["patch_ms"][op], 0),
                         c["host_syncs"], c["tensor_walks"], c["aten_ops"], c["layers_written"],
                         f"{c['backup_bytes_read'] / 2**20:.1f}", f"{c['bytes_across'] / 2**20:.1f}"])
    return lines + table(["family", "dtype", "change", "ms (whole)", "of which patching ms", "host syncs",
                          "tensor walks", "aten ops", "layers written", "originals read MiB",
                          "MiB across devices"], rows)


def _fp8(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## fp8 weight storage ({cfg['step_dtype']} compute, {cfg['resolution']}² px, three LoRAs as bypasses "
             "or fused into compute-dtype copies of the touched layers)", ""]
    measured = [s for s in results["fp8"] if "skipped" not in s]
    lines += table(["family", "resting GiB, all weights in the compute dtype", "resting GiB, fp8",
                    "resting GiB, fp8 + fused copies", "ratio fp8 / full", "layers in fp8", "layers copied",
                    "copies built ms", "pixels bypass vs fused: max / mean"],
                   [[s["family"], f"{s['resting_gib']['full']:.2f}", f"{s['resting_gib']['fp8']:.2f}",
                     f"{s['resting_gib']['fp8 + fused copies']:.2f}", f"{s['resting_ratio']:.2f}×", s["stored_layers"],
                     s["fused_copies"]["layers"], f"{s['fused_copies']['build_ms']:.0f}",
                     f"{s['bypass_vs_fused_pixels']['max']} / {s['bypass_vs_fused_pixels']['mean']:.3f}"]
                    for s in measured])
    return lines + table(HEADER, _comparison_rows(results["fp8"]))


def _timeline(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """Time outside the denoiser per generation, our timeline's phases (median ms) and host syncs."""
    measured = [s for s in results["timeline"] if "skipped" not in s]
    lines = [f"## Per image: one generation outside the denoiser ({cfg['step_dtype']}, {cfg['resolution']}² px, "
             f"{measured[0]['steps'] if measured else '?'} steps; ours writes the PNG, diffusers returns PIL)", ""]
    lines += table(HEADER, _comparison_rows(measured))
    for s in measured:
        for variant, phases in s["phases_ms"].items():
            lines += [f"{s['family']}, {variant}: " + ", ".join(f"{name} {p['cpu_ms']:.1f}/{p['wall_ms']:.1f}"
                                                            for name, p in phases.items()) + " (CPU/wall ms)", ""]
        lines += [f"{s['family']}, host syncs per generation: " + "; ".join(
            f"{side} {c['total']} ({', '.join(f'{site} {n}' for site, n in c['sites'].items())})"
            for side, c in s["host_syncs"].items()), ""]
    return lines


def _fp8_compute(results: dict[str, Any], _cfg: dict[str, Any]) -> list[str]:
    lines = ["## fp8 compute: casts and matrix products per denoiser call (meta device, full-size bf16 models, "
             "batch 1; fp8 storage widens each stored weight per call, fp8-compute multiplies in fp8)", ""]
    rows = []
    for s in results["fp8-compute"]:
        for weights, kinds in s["per_call"].items():
            products = ", ".join(f"{k} {v:g}" for k, v in kinds.items() if k.split(" ")[0] not in
                                 ("widen", "widened", "quantise"))
            rows.append([s["family"], f"{s['resolution']}²", weights, f"{kinds.get('widen', 0):g}",
                         f"{kinds.get('widened elements', 0) / 1e6:,.0f}", f"{kinds.get('quantise', 0):g}", products])
    return lines + table(["family", "px", "weights", "widening casts", "widened elements (M)", "input quantisations",
                          "matrix products by op and dtype"], rows)


def _compile(results: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = [f"## First compile, whole denoiser vs regional (meta device, full-size {cfg['storage_dtype']} "
             "models, dynamo + AOTAutograd traces: the `aot_eager` backend)", ""]
    return lines + table(["family", "scope", "first compile s", "graphs", "blocks compiled by regions",
                          "whole / regional"],
                         [[s["family"], scope, f"{s[scope]['first_compile_s']:.1f}", s[scope]["graphs"],
                           s[scope]["blocks"] or "–", f"{s['ratio']:.1f}×" if scope == "regional" else ""]
                          for s in results["compile"] if "skipped" not in s for scope in ("whole", "regional")])


# (results key, section, what a skip note calls it): a section is drawn only when it was measured.
SECTIONS = (("load", _load, "load"), ("step", _step, "step"), ("reweight", _reweight, "re-weight"),
            ("fp8", _fp8, "fp8"), ("ops", _ops, "ops"), ("timeline", _timeline, "timeline"),
            ("fp8-compute", _fp8_compute, "fp8 compute"), ("compile", _compile, "compile"))


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
    notes += [f"- step {s['family']}: {note}" for s in results.get("step", []) if "skipped" not in s
              for note in (s["fused_note"], s["baseline_note"]) if note]
    return "\n".join(lines + (["## Not measured, or measured otherwise", "", *notes, ""] if notes else []))


def write(results: dict[str, Any], out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    paths["md"].write_text(render(results) + "\n")
    return paths
