"""Redraw docs/images/report.png, the README's picture of a report: the bundled all-MiniLM-L6-v2 on one
sentence, with one head opened. Needs Chromium (/usr/bin/chromium or $ATTNPROBE_CHROMIUM) and playwright.

    python docs/images/screenshot.py
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

HERE = Path(__file__).resolve().parent
SENTENCE = "The cat sat on the mat because it was tired."

with tempfile.TemporaryDirectory() as folder:
    report = Path(folder) / "report.html"
    subprocess.run(
        [sys.executable, "-m", "attnprobe.cli", "report", "--text", SENTENCE, "--out", str(report), "-q"], check=True
    )
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=os.environ.get("ATTNPROBE_CHROMIUM", "/usr/bin/chromium"))
        page = browser.new_page(viewport={"width": 1280, "height": 1150}, device_scale_factor=1)
        page.goto(report.as_uri() + "#head-2-3")
        page.evaluate("window.attnprobe.ready")
        page.evaluate("document.querySelector('#grid').scrollIntoView()")
        page.wait_for_timeout(500)
        page.screenshot(path=str(HERE / "report.png"), full_page=False)
        browser.close()
print(f"wrote {HERE / 'report.png'}")
