"""DCP folders as an attacker or a damaged disk leaves them."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any


def replace_planner_data(folder: Path, value: Any) -> None:
    """Rewrite ``folder/.metadata`` (plain pickle) with its ``planner_data`` set to ``value``."""
    with open(folder / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    metadata.planner_data = value
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
