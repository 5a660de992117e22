"""Run the invariant test file next to this script (test_attention_masks.py) with pytest.

Installing attnprobe installs a pytest plugin with two fixtures, ``attnprobe_capture`` and ``assert_attention``;
the test file uses them to assert that a decoder masks padding and the future, and that a decoder which drops
its padding mask is caught.

    python examples/invariant_test.py
"""

import sys
from pathlib import Path

import pytest

here = Path(__file__).resolve().parent
code = pytest.main(["-q", "-p", "no:cacheprovider", str(here / "test_attention_masks.py")])
sys.exit(int(code))
