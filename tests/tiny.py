"""Constants every engine test shares: the demo checkpoints' names and the cheapest generation."""

# Two steps at 64², the smallest size the tiny models take: enough to run scheduler, UNet, VAE.
FAST = dict(steps=2, width=64, height=64, cfg=5.0, sampler="Euler")
CHECKPOINTS = {"sd15": "tiny-sd15.safetensors", "sdxl": "tiny-sdxl.safetensors",
               "flux-dev": "tiny-flux-dev.safetensors"}
