"""Dataset configs: ``configs/data/<name>.yaml`` is the single source of defaults and names."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from data.errors import DataError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DATA_CONFIG_DIR = CONFIG_DIR / "data"


def known_datasets() -> tuple[str, ...]:
    """Names with a config under ``configs/data/``: adding a yaml there adds a dataset."""
    return tuple(sorted(p.stem for p in DATA_CONFIG_DIR.glob("*.yaml")))


def resolve_config(cfg: Mapping[str, Any] | DictConfig) -> dict[str, Any]:
    """Overlay ``cfg`` on the defaults of its named dataset, so ``{"name": "shakespeare"}``
    means the same as the Hydra-composed ``data=shakespeare``."""
    user = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    name = user.get("name")
    if not name:
        raise DataError(f"data config has no 'name'; known datasets: {', '.join(known_datasets())}")
    path = DATA_CONFIG_DIR / f"{name}.yaml"
    if path.is_file():
        defaults = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        return {**defaults, **user}
    if "source" in user:  # a dataset defined entirely by the caller's own config
        return user
    raise DataError(f"unknown dataset {name!r}; known: {', '.join(known_datasets())}")


def cache_root(cfg: Mapping[str, Any]) -> Path:
    """Where prepared data lives; never relative to cwd, so scripts work from any directory."""
    configured = cfg.get("cache_dir") or os.environ.get("CAUSALGPT_CACHE")
    root = Path(configured) if configured else Path.home() / ".cache" / "causalgpt"
    return root.expanduser().resolve()
