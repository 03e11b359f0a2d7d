"""Checkpoints: our own (save, load, verify, find), the sources `checkpoint=` names, and the
Hugging Face interchange (GPT-2 / Llama in and out). Imports base/, model/ and data/ only."""
