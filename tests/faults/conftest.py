"""Fault tests train on the training tests' small corpus (see tests/trainer/conftest.py)."""

from tests.conftest import corpus  # noqa: F401
