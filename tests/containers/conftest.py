"""The container tier (tests/helpers/containers.py says how it runs here): one session's
prepared machine and the image built from the project's own Dockerfile."""

from __future__ import annotations

import pytest
from helpers.containers import IMAGE, ROOT, Containers, environment


@pytest.fixture(scope="session")
def containers() -> Containers:
    """The prepared machine, with the project's image built from its own Dockerfile."""
    tier = Containers(environment())
    tier.podman("build", "--quiet", "-t", IMAGE, "--build-arg",
                f"TORCH_INDEX_URL={tier.env['OFFLOOP_TORCH_INDEX_URL']}", str(ROOT), timeout=1200)
    return tier
