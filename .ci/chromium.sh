#!/usr/bin/env bash
# The browser the report tests drive: Debian's Chromium. Installed when missing and this machine allows it
# (root, or passwordless sudo, with apt-get); otherwise one line on how to get it, and the browser tests are
# then reported as skipped by pytest (never as passed). Never a browser downloaded by a test tool.
set -u
if [ -n "${ATTNPROBE_CHROMIUM:-}" ] && [ -x "${ATTNPROBE_CHROMIUM}" ]; then exit 0; fi
if [ -x /usr/bin/chromium ]; then exit 0; fi
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=none; fi
  if [ "$sudo" != none ]; then
    echo "== installing Debian's chromium for the browser tests (apt-get, about a minute)"
    if $sudo apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null; then
      exit 0
    fi
  fi
fi
echo "attnprobe: Chromium not found and not installable here: the browser tests will be reported as skipped. Get it with 'sudo apt-get install chromium' (Debian/Ubuntu) or set ATTNPROBE_CHROMIUM=/path/to/chromium" >&2
exit 0
