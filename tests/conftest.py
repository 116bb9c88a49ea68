"""Shared test fixtures: the repository on sys.path and the shared data samples."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def data_dir() -> str:
    """The real dataset samples: $ARCO_DATA_DIR, else ../shared/data beside the checkout."""
    for d in (os.environ.get("ARCO_DATA_DIR"), REPO.parent / "shared" / "data"):
        if d and (Path(d) / "hotpotqa").is_dir():
            return str(d)
    pytest.skip("no shared data: set ARCO_DATA_DIR to the folder holding hotpotqa/, 2wiki/, musique/")


@pytest.fixture(scope="session")
def retriever():
    import env
    return env.Retriever()
