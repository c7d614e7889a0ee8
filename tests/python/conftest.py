"""Shared fixtures of the kiln package's tests (run by ctest: python.<file>, PYTHONPATH=<build>/python)."""
import os
import pathlib

import pytest

from kiln.driver import CPU
from kiln.engine import InferenceSession

SOURCE_DIR = pathlib.Path(os.environ.get("KILN_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))


@pytest.fixture
def session():
    return InferenceSession(devices=[CPU()])
