"""Print pip constraints pinning every `>=X` requirement of pyproject.toml (runtime and dev) to `==X`: the oldest
declared releases, which .ci/run installs and tests so that nothing is declared that is not tested."""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml").read_text())["project"]
requirements = [*project["dependencies"], *project.get("optional-dependencies", {}).get("dev", [])]
for requirement in requirements:
    match = re.match(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", requirement)
    if not match:
        sys.exit(f"no lower bound in {requirement!r}: every requirement needs one (CI tests it)")
    print(f"{match.group(1)}=={match.group(2)}")
