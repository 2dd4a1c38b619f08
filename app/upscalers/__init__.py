"""ESRGAN-class upscaler models (ESRGAN, RealESRGAN, SwinIR, DAT, … read by spandrel): finding and
reading their files (`files`), what spandrel makes of them and in which dtype they run (`arch`), tiled
upscaling with overlap (`tiling`) and the tiny demo file (`demo`). The engine owns the loaded model
as one more placed component: `app.engine.upscaler_slot`.
"""
