"""Steady Diffusion: a diffusion app whose engine never mixes devices or dtypes.

Importing any part of the app first sets `HF_HUB_OFFLINE=1`: `huggingface_hub` reads the flag once,
at its import, and nothing here may ever download weights or configs from a hub.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
