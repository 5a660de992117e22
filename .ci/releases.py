"""Print the transformers releases .ci/run tests between the oldest and the newest: the latest patch of every minor
release that pyproject.toml's `transformers` requirement admits, leaving out the newest (step 2 installs it) and the
oldest declared one (step 3 pins it). Together the three steps cover every minor release the range declares.

transformers changes internals attnprobe relies on between minor releases (5.24 renamed `past_key_values` to `cache`),
so a range is only as good as the releases in it that were tested. Run with the Python of an environment that has
`packaging` (transformers needs it); the releases come from the package index pip is configured for.
"""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

project = tomllib.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml").read_text())["project"]
declared = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "transformers")
listing = subprocess.run(
    [sys.executable, "-m", "pip", "index", "versions", "transformers"], capture_output=True, text=True, check=True
).stdout
match = re.search(r"Available versions:\s*(.+)", listing)
if not match:
    sys.exit(f"pip index printed no versions of transformers:\n{listing}")
admitted = sorted(
    v for v in map(Version, match.group(1).split(", ")) if not v.is_prerelease and declared.specifier.contains(v)
)
if not admitted:
    sys.exit(f"no release of transformers is admitted by {declared}")
latest_patch = {}
for version in admitted:
    latest_patch[version.release[:2]] = version  # ascending: the last one of each minor stays
oldest = min(Version(s.version) for s in declared.specifier if s.operator == ">=")
for version in sorted(latest_patch.values()):
    # the oldest declared minor by its minor number: step 3 pins 5.16 (5.16.0) while its latest patch is 5.16.1
    if version != admitted[-1] and version.release[:2] != oldest.release[:2]:
        print(version)
