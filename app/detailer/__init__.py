"""Detailer (ADetailer-compatible): find faces, hands or people, mask them, and redraw each region.

`units` is the record of one ADetailer tab, `detect` finds regions with the built-in face detector or
a user's ONNX detector from `models/adetailer/`, `masks` applies ADetailer's mask rules to them.
"""
