"""The training tests' small corpus, for the multi-process runs too."""

from tests.conftest import corpus  # noqa: F401 - a fixture, used by name
