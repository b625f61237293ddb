"""Read docker-compose.yml as Compose does.

`docker-compose config` (Debian's docker-compose) resolves the file: anchors, variables,
defaults. Its YAML is read with the YAML module docker-compose itself runs on, so the
suite needs no YAML package of its own. The containers themselves run in
tests/containers/ (podman).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["compose_config", "read_yaml", "ROOT"]

ROOT = Path(__file__).resolve().parent.parent.parent
_YAML_TO_JSON = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"


def _docker_compose() -> str:
    binary = shutil.which("docker-compose")
    assert binary, ("the tests need Debian's `docker-compose`: run `make system-deps` "
                    "(scripts/system-deps.sh) or `apt-get install docker-compose`")
    return binary


def read_yaml(text: str) -> Any:
    """YAML -> Python, with the interpreter (and PyYAML) docker-compose runs on."""
    with open(_docker_compose(), "rb") as script:
        shebang = script.readline().decode().removeprefix("#!").split()
    assert shebang, "docker-compose has no #! line to find its Python from"
    done = subprocess.run([*shebang, "-c", _YAML_TO_JSON], input=text, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def compose_config(*files: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """(resolved config, its YAML) of the compose files, as `docker-compose config` prints it."""
    args = [_docker_compose()]
    for name in files or ("docker-compose.yml",):
        args += ["-f", str(ROOT / name)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOOP_", "GRAFANA_"))}
    required = {"GRAFANA_ADMIN_PASSWORD": "a-test-password"}  # compose has no default for it
    done = subprocess.run([*args, "config"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**clean, **required, **(env or {})})
    assert done.returncode == 0, f"docker-compose config failed:\n{done.stderr}"
    return read_yaml(done.stdout), done.stdout
