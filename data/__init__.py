"""Data: tokenizers (data/tokenizer.py), where documents come from (data/sources.py), their
cached preparation into token files (data/pipeline.py, `python -m data.prepare`), and batches
(data/loader.py)."""

from base.errors import DataError
from data.loader import BatchSampler, bits_per_byte, iter_eval_batches
from data.pipeline import PreparedData, known_datasets, prepare_data
from data.tokenizer import get_tokenizer, load_tokenizer

DATASETS: tuple[str, ...] = known_datasets()

__all__ = [
    "DATASETS",
    "BatchSampler",
    "DataError",
    "PreparedData",
    "bits_per_byte",
    "get_tokenizer",
    "iter_eval_batches",
    "load_tokenizer",
    "prepare_data",
]
