"""Print the floor of every version pyproject.toml declares for llmtune's dependencies (and the deepspeed extra),
as `name==version` pins for pip: `make test-floor` installs exactly the oldest versions we say we support."""

import re
import sys
from pathlib import Path

import tomllib

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
declared = project["dependencies"] + project["optional-dependencies"]["deepspeed"]
pins = []
for requirement in declared:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", requirement.replace(" ", ""))
    if match is None:
        sys.exit(f".ci/floors.py: {requirement!r} in pyproject.toml has no plain `>=` floor to test")
    name, version = match.groups()
    pins.append(f"{name}=={version}")  # PEP 440: 2.11 == 2.11.0
print(" ".join(pins))  # noqa: T201 (pip reads it)
