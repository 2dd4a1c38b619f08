"""ControlNet units in the engine's jobs: checked before queueing, attached on the worker, one map set per pass.

`ControlRuns` is a part of `Engine` (its base class). A job's units are checked before it is queued (each
model is in `models/ControlNet/`, usable, and made for the family the job runs on; the workflow has a
control pipeline), then on the worker the stack is attached as a component of the loaded model
(`ControlNetSlot.ensure_controlnets`) and every tensor is verified; each denoising pass gets its maps at its
own size (`ControlPass`). With hires fix a unit's `hr_option` says which passes it controls: a unit left
out of a pass runs at weight 0, which adds exact zeros (the stack keeps one entry per unit, as the control
pipelines require), so a pass without it equals one that never had it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from PIL import Image

from app.controlnet import infotext as control_infotext
from app.controlnet.files import ControlNetFileError
from app.controlnet.maps import control_map, source_of
from app.controlnet.units import HR_OPTIONS, ControlUnit, check_units
from app.engine.snapshot import EngineState
from app.families import family, family_of

# which pass -> the hr_options that run in it ("only": no hires fix, every unit runs)
_PASSES = {"only": HR_OPTIONS, "first": (HR_OPTIONS[0], HR_OPTIONS[1]), "hires": (HR_OPTIONS[0], HR_OPTIONS[2])}


@dataclass(frozen=True)
class ControlPass:
    """One denoising pass's units and their maps at its size; `arguments` are the control pipeline's."""

    units: tuple[ControlUnit, ...]
    maps: tuple[Image.Image, ...]

    def arguments(self, stage, kind: str, guidance: float) -> dict:
        kit = family_of(stage).controlnet
        return kit.arm(getattr(stage, kit.component), kind, self.maps, self.units, guidance)


def units_for_pass(units: tuple[ControlUnit, ...], which: str) -> tuple[ControlUnit, ...]:
    """The units with weight 0 where `hr_option` keeps them out of pass `which` ("only", "first", "hires")."""
    return tuple(u if u.hr_option in _PASSES[which] else dataclasses.replace(u, weight=0.0) for u in units)


class ControlRuns:
    """The ControlNet half of `Engine` (see the module docstring)."""

    def controlnet_models(self, family_name: str | None = None) -> list[str]:
        """`name [hash]` of every usable ControlNet (`family_name`'s only, when given): `/controlnet/model_list`."""
        return self.controlnet_library.titles(family_name)

    def unload_controlnets(self):
        """Detach the ControlNet stack from the loaded model and give its memory back (the next unit reads its
        model again); a transition of its own, verified like any."""
        return self._call("unload_controlnets", "", EngineState.MOVING, self._lifecycle.release_controlnets)

    def _check_units(self, units: tuple[ControlUnit, ...], family_name: str | None, kind: str) -> None:
        """Refuse, before queueing, units the job cannot run: too many, a model missing, pickled, unreadable
        or made for another family, or a family or workflow (`kind`) without a control pipeline."""
        if not units:
            return
        check_units(units)
        if self.settings.compile:
            raise ValueError("ControlNet units run on the eager model: turn the compiled path (--compile) off")
        if family_name is None:
            return
        fam = family(family_name)
        if fam.controlnet is None:
            raise ValueError(f"{fam.label} models take no ControlNet: remove the ControlNet units")
        if kind not in fam.controlnet.pipelines:
            raise ValueError(f"ControlNet units with {kind} are not available for {fam.label} models yet")
        library = self.controlnet_library
        for i, unit in enumerate(units):
            if unit.image is not None or kind == "txt2img":  # img2img: a unit without one reads the init image
                source_of(i, unit, None)
            entry = library.resolve(unit.model)
            made_for = library.facts(entry)[1]
            if family_name not in made_for:
                what = f"{family(made_for[0]).label} models" if made_for else "no model family here"
                raise ControlNetFileError(f"ControlNet unit {i}: {entry.name} is made for {what}; the model is "
                                          f"{fam.label}: choose a {fam.label} ControlNet")

    def _control_ready(self, units: tuple[ControlUnit, ...]) -> tuple[str, ...]:
        """On the worker: the units' stack attached to the loaded model, every tensor verified after; returns
        the models' `name [hash]` titles in unit order (for the infotext)."""
        if not units:
            return ()
        library = self.controlnet_library
        entries = [library.resolve(u.model) for u in units]
        before = self._lifecycle.controlnets
        if self._lifecycle.ensure_controlnets(entries) is not before:  # the same stack: nothing moved since the
            self._verify_and_repair("after attaching ControlNets")  # verify that began this transition
        return tuple(library.title(e) for e in entries)

    def _control_pass(self, params, which: str, init: Image.Image | None = None) -> ControlPass | None:
        """Pass `which`'s units and maps at `params`' size (None: the job has no units)."""
        units = params.controlnet_units
        if not units:
            return None
        maps = tuple(control_map(i, u, init, params.width, params.height,
                                 self.settings.controlnet_preprocessor_dir)
                     for i, u in enumerate(units))
        return ControlPass(units_for_pass(units, which), maps)

    @staticmethod
    def _control_infotext(units: tuple[ControlUnit, ...], titles: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
        return control_infotext.infotext_pairs(units, titles) if units else ()
