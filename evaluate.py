"""Evaluate a checkpoint: `python evaluate.py checkpoint=<dir> [text_file=<path>] [stride=N]`."""

import json

from omegaconf import DictConfig, OmegaConf

from base.entry import hydra_main
from base.errors import user_errors
from trainer.evaluation import evaluate_checkpoint


@hydra_main("evaluate")
def main(cfg: DictConfig) -> None:
    with user_errors():
        result = evaluate_checkpoint(OmegaConf.to_container(cfg, resolve=True))
    print(
        f"{result['data']}: {result['tokens']:,} tokens, {result['bytes']:,} bytes, "
        f"{result['method']} of {result['block_size']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
