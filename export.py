"""Export to Hugging Face, `python export.py checkpoint=<dir> out=<dir>`, or to llama.cpp,
`... out=model.gguf format=gguf` (configs/export.yaml)."""

from omegaconf import DictConfig, OmegaConf

from base.errors import hydra_main, user_errors


@hydra_main("export")
def main(cfg: DictConfig) -> None:
    from gguf import GGUFReader  # once Hydra has checked the config: see train.py

    from checkpoints.export import export_checkpoint

    with user_errors():
        out = export_checkpoint(OmegaConf.to_container(cfg, resolve=True))
    if cfg.format == "gguf" and "tokenizer.chat_template" in GGUFReader(out).fields:
        how = f"chat with it in llama.cpp (its template formats the turns): llama-cli -m {out}"
    elif cfg.format == "gguf":  # -n 32: within the positions of a learned-position model
        how = f"run it with llama.cpp, e.g. llama-completion -m {out} -no-cnv -n 32 -p 'The'"
    else:
        how = f"load it with transformers' AutoModelForCausalLM.from_pretrained('{out}')"
    print(f"wrote {out}: {how}")


if __name__ == "__main__":
    main()
