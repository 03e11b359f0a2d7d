"""Data: tokenizers (data/tokenizer.py), where documents come from (data/sources.py), their
cached preparation into token files (data/pipeline.py, `python -m data.prepare`), and batches
(data/loader.py). Import from the module that holds a name: importing the package loads none."""
