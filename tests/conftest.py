"""Settings every test shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory) -> Iterator[None]:
    """The run's caches (the disk's I/O profile, built kernels, tokenized corpora) in a folder of
    the session's own, never the user's: a test's quick probe of the disk, kept as the machine's
    profile, would set the chunk size of the user's later runs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield
