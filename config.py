"""Run configurations: frozen dataclasses and the named presets (smoke, dev, record).

Each concern owns one section below. A preset name selects one entry from every section; the
command line of train_gpt.py overrides individual fields.
"""
from __future__ import annotations

from dataclasses import dataclass


# ================================================================================================
# Model dimensions (used by model/).
# ================================================================================================


# ================================================================================================
# Schedule and optimizer (used by optim/).
# ================================================================================================
