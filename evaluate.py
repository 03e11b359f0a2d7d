"""Evaluate a checkpoint: `python evaluate.py checkpoint=<dir> [text_file=<path>] [stride=N]`, or
on downstream tasks: `python evaluate.py checkpoint=<dir> task=hellaswag` (configs/task/)."""

import json

from omegaconf import DictConfig, OmegaConf

from base.errors import hydra_main, user_errors


@hydra_main("evaluate")
def main(cfg: DictConfig) -> None:
    from evals.loss import evaluate_checkpoint  # once Hydra has checked the config

    plain = OmegaConf.to_container(cfg, resolve=True)
    with user_errors():
        if "name" in (plain["task"] or {}) or plain["tasks"]:
            from evals.tasks import evaluate_tasks  # loaded for tasks alone

            result = evaluate_tasks(plain, say=print)
        else:
            result = evaluate_checkpoint(plain, say=print)
    if "tasks" not in result:
        print(f"loss {result['loss']:.4f}, bpb {result['bpb']:.4f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
