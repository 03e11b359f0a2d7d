"""Data pipeline: tokenizers, dataset preparation with caching, batch sampling, bits per byte."""

from data.config import known_datasets
from data.errors import DataError
from data.metrics import bits_per_byte
from data.pipeline import PreparedData, prepare_data
from data.sampler import BatchSampler, iter_eval_batches
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
