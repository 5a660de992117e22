"""The attention math and the statistics engine: logits and masked softmax written once
(``attention_math``), per-row statistics block by block (``stats``), pooled overviews and exact windows
(``pooling``), and what rows sum to with attention sinks (``sinks``)."""
