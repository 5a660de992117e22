#!/usr/bin/env bash
# The type checker over the package (configured in pyproject.toml, [tool.mypy]). The repository root is the
# package `attnprobe`, whatever the checkout's folder is called, so mypy reads it through a link of that name.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-"$repo/.venv/bin/python"}
link=$(mktemp -d)
trap 'rm -rf "$link"' EXIT
ln -s "$repo" "$link/attnprobe"
cd "$link"
"$python" -m mypy --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" "$@"
