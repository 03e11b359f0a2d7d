"""Serve a trained causalgpt: `python serve.py checkpoint=... [host=127.0.0.1] [port=8000]`
(see configs/serve.yaml and docs/serving.md)."""

import sys

from omegaconf import DictConfig

from base.errors import hydra_main


@hydra_main("serve")
def serve(cfg: DictConfig) -> None:
    from inference.server import main  # once Hydra has checked the config: see train.py

    sys.exit(main(cfg))


if __name__ == "__main__":
    serve()
