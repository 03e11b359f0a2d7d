"""CLI: ``python -m data.prepare data=<name> [data.key=value ...]`` prepares one dataset.

It prints per-split tokens, bytes and throughput (when it builds), the split sizes (always),
then one JSON summary line. User mistakes print ``error: <msg>`` on stderr and exit 2
(base/errors.py).
"""

from __future__ import annotations

import json
import sys
import time

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig

from base.errors import CONFIG_DIR, DataError, user_errors
from data.pipeline import known_datasets, prepare_data


def _compose(overrides: list[str]) -> DictConfig:
    """Compose ``configs/prepare.yaml`` with command-line overrides, as training does."""
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return compose(config_name="prepare", overrides=overrides)
    except (HydraException, MissingConfigException) as e:
        first_line = str(e).strip().splitlines()[0]
        raise DataError(f"{first_line} (known datasets: {', '.join(known_datasets())})") from None


def main(argv: list[str] | None = None) -> int:
    """CLI: prepare one dataset and end with a one-line JSON summary."""
    start = time.perf_counter()
    with user_errors():
        data = prepare_data(_compose(sys.argv[1:] if argv is None else argv).data)
    splits = data.meta["splits"]
    total = sum(stats["bytes"] for stats in splits.values())
    sizes = [
        f"{split} {stats['tokens']:,} tokens, {stats['bytes'] / 1e6:.2f} MB "
        f"({stats['bytes'] / total:.1%} of the text)"
        for split, stats in splits.items()
    ]
    print("splits: " + " | ".join(sizes))
    summary = {"dataset": data.meta["dataset"]}
    for split, stats in splits.items():
        summary[split] = {key: stats[key] for key in ("documents", "tokens", "bytes")}
    summary |= {"seconds": round(time.perf_counter() - start, 3), "dir": str(data.dir)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
