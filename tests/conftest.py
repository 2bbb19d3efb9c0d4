import os

import pytest


# Profiles built during tests go to a per-session temporary cache, never the user's.
@pytest.fixture(autouse=True, scope="session")
def _isolated_profile_cache(tmp_path_factory):
    os.environ["LLMEM_CACHE_DIR"] = str(tmp_path_factory.mktemp("llmem-cache"))
    yield
