"""ControlNet: control models beside the denoiser, their preprocessors and the units that ask for them.

A ControlNet is one more component of the loaded model: placed, offloaded, verified and shown in
Diagnostics like the denoiser (the seeds' bug class lives wherever a second model meets the first).
"""
