"""An invariant test in pytest, with the fixtures attnprobe's pytest plugin installs.

pytest examples/test_attention_masks.py      # or: python examples/invariant_test.py
"""

import pytest
import torch

import attnprobe


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = attnprobe.MultiHeadAttention(16, num_heads=4, causal=True)

    def forward(self, x, attention_mask):
        return self.attn(x, attention_mask=attention_mask)


class ForgetfulDecoder(Decoder):
    def forward(self, x, attention_mask):
        return self.attn(x)  # the bug: the padding mask never reaches attention


@pytest.fixture
def batch():
    torch.manual_seed(0)
    attention_mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1],  # left padding
            [1, 1, 1, 1, 1, 1],
        ]
    )
    return torch.randn(2, 6, 16), attention_mask


def test_decoder_masks_padding_and_the_future(attnprobe_capture, assert_attention, batch):
    x, attention_mask = batch
    model = Decoder().eval()
    with attnprobe_capture(model) as cap:
        model(x, attention_mask)
    result = assert_attention(cap, causal=True, attention_mask=attention_mask)
    assert result.coverage["padding"] == 1


def test_a_dropped_mask_is_caught(attnprobe_capture, assert_attention, batch):
    x, attention_mask = batch
    model = ForgetfulDecoder().eval()
    with attnprobe_capture(model) as cap:
        model(x, attention_mask)
    with pytest.raises(attnprobe.InvariantError, match="padded key"):
        assert_attention(cap, causal=True, attention_mask=attention_mask)
