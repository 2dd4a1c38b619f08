"""ESRGAN-class upscaler models (ESRGAN, RealESRGAN, SwinIR, DAT, … read by spandrel): finding and
reading their files (`files`), what spandrel makes of a file and the dtype it runs in (`arch`), tiled upscaling
with overlap (`tiling`), the Extras settings and infotext (`extras`) and the tiny demo file (`demo`); face
restoration's model files (`faces`) and its crop, restore and feathered paste (`face_paste`).
The engine owns each loaded model as one more placed component: `app.engine.upscaler_slot`.
"""
