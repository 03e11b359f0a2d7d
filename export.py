"""Export to Hugging Face, `python export.py checkpoint=<dir> out=<dir>`, or to llama.cpp,
`... out=model.gguf format=gguf` (configs/export.yaml)."""

import hydra
from omegaconf import DictConfig, OmegaConf

from base.errors import user_errors
from checkpoints.export import export_checkpoint


@hydra.main(config_path="configs", config_name="export", version_base=None)
def main(cfg: DictConfig) -> None:
    with user_errors():
        out = export_checkpoint(OmegaConf.to_container(cfg, resolve=True))
    if cfg.format == "gguf":
        print(f"wrote {out}: run it with llama.cpp: llama-completion -m {out} -no-cnv -p 'ROMEO:'")
    else:
        print(
            f"wrote {out}: load it with transformers' AutoModelForCausalLM.from_pretrained('{out}')"
        )


if __name__ == "__main__":
    main()
