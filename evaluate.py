"""Evaluate a checkpoint: `python evaluate.py checkpoint=<dir> [text_file=<path>] [stride=N]`, or
on downstream tasks: `python evaluate.py checkpoint=<dir> task=hellaswag` (configs/task/)."""

import json

from omegaconf import DictConfig, OmegaConf

from base.errors import hydra_main, user_errors


@hydra_main("evaluate")
def main(cfg: DictConfig) -> None:
    from evals.loss import evaluate_checkpoint  # once Hydra has checked the config

    with user_errors():
        result = evaluate_checkpoint(OmegaConf.to_container(cfg, resolve=True), say=print)
    if "tasks" not in result:
        print(f"loss {result['loss']:.4f}, bpb {result['bpb']:.4f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
