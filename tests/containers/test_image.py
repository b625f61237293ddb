"""The image built from the project's Dockerfile, run as users run it."""

from __future__ import annotations

import json

import pytest
from helpers.containers import IMAGE

# the first test of the tier also prepares the machine and builds the image (minutes)
pytestmark = pytest.mark.timeout(1500)


def test_the_images_default_command_trains_the_demo_and_exits_0(containers):
    done = containers.podman("run", "--rm", IMAGE, timeout=300)
    assert "eval accuracy" in done.stdout and "finished" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "could not be started" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_nothing_in_the_images_working_directory_shadows_the_installed_package(containers):
    probe = ("import json, os, offloop.workers.spawned as w; print(json.dumps({'listing': os.listdir(), "
             "'module': os.path.dirname(w.__file__), 'uid': os.getuid()}))")
    seen = json.loads(containers.podman("run", "--rm", IMAGE, "python", "-c", probe, timeout=120).stdout)
    assert not {"offloop", "bus", "trainer.py", "workers"} & set(seen["listing"]), seen
    assert "site-packages" in seen["module"] or "dist-packages" in seen["module"], seen  # the installed wheel
    assert seen["uid"] == 10001  # the image's unprivileged user
    # the compose file's healthcheck, by its absolute path: unhealthy, saying why, with no run
    healthcheck = containers.podman("run", "--rm", IMAGE, "python", "/opt/offloop/deploy/healthcheck.py",
                                    "run", "nowhere", timeout=60, check=False)
    assert healthcheck.returncode == 1 and "nowhere" in healthcheck.stdout + healthcheck.stderr, healthcheck
