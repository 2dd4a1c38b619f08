"""The benchmark package (`python -m app.bench`); see `bench.py` for what it measures.

A package so the concepts live one per file (config, measure, stats, workload, the two sides,
report, CPU proxies). The hub goes offline before any Hugging Face import, as in app/__init__.py.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
