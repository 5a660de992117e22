"""Hugging Face capture under torch.inference_mode(): inference tensors keep no version counter, which the
mask memo used to read (RuntimeError inside the model's forward)."""

import pytest
import torch
from hf_helpers import MODELS, build, inputs

import attnprobe


def _logits(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", MODELS)
def test_capture_under_inference_mode_leaves_outputs_unchanged_and_checks_clean(name):
    model = build(name)
    batch = inputs(name, padding="left")
    with torch.inference_mode():
        plain = _logits(model(**batch))
        with attnprobe.capture(model) as cap:
            captured = _logits(model(**batch))
    assert torch.equal(plain, captured)
    assert len(cap) > 0
    result = attnprobe.check(cap)
    assert result.ok, result.table()
    for record in cap:  # records are ordinary tensors, usable outside inference mode
        assert record.weights is not None and not record.weights.is_inference()
