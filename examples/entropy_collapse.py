"""Attention entropy collapse, watched with attnprobe.monitor: the same small transformer trained twice on a
synthetic task, once with a stable learning rate and once with one too high, the monitor on in both.

Writes a PNG of the loss, each layer's lowest head entropy and the largest attention logit against the step,
one HTML page per run beside it (``attnprobe.reports.monitor_html``: the monitor's statistics per layer and per
head, and its alerts), and prints which alerts fired and when, next to the step where the loss diverged (if it did).

    python examples/entropy_collapse.py                 # 2 x 300 steps, a few minutes on a laptop CPU
    python examples/entropy_collapse.py --steps 40      # a quick look

The task: sequences of random tokens whose second half repeats the first; the model must copy (an induction
task). Post-LayerNorm blocks without qk-normalisation, Adam: the setting in which Zhai et al. (2023) and
Wortsman et al. (2023) saw attention entropy collapse and logit growth come with divergence.
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch
from torch import nn

import attnprobe


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.attn = attnprobe.MultiHeadAttention(d, num_heads=heads, causal=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        x = self.ln1(x + self.attn(x))  # post-LN, no qk-norm
        return self.ln2(x + self.mlp(x))


class Model(nn.Module):
    def __init__(self, vocab=32, length=32, d=64, heads=4, layers=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.out = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def batch(generator, size=32, half=16, vocab=32):
    first = torch.randint(0, vocab, (size, half), generator=generator)
    ids = torch.cat([first, first], dim=1)
    return ids[:, :-1], ids[:, 1:]


def run(lr, steps, every, seed=0):
    torch.manual_seed(seed)
    model = Model().train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed)
    losses = []
    alerts = {"entropy_below": 0.05, "max_score_above": 50.0, "nonfinite": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attnprobe.AttnprobeWarning)  # kept in mon.alerts, printed below
        with attnprobe.monitor(model, every=every, alerts=alerts) as mon:
            for _ in range(steps):
                x, y = batch(data)
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    return losses, mon


def diverged_at(losses, window=20):
    """The first step after which the loss stays above its best so far by 1 nat (or is not finite)."""
    best = math.inf
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return i
        best = min(best, loss)
        if i >= window and all(later > best + 1.0 for later in losses[i : i + window]):
            return i
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rates", type=float, nargs=2, default=(1e-3, 3e-2), metavar=("STABLE", "HIGH"))
    parser.add_argument("--out", default="entropy_collapse.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for lr, style in zip(args.rates, ("-", "--")):
        losses, mon = run(lr, args.steps, args.every)
        history, alerts = mon.history, mon.alerts
        page = Path(args.out).with_name(f"{Path(args.out).stem}-lr{lr:g}.html")
        attnprobe.reports.monitor_html(mon, page, title=f"entropy collapse: lr {lr:g}", overwrite=True)
        print(f"wrote {page}")
        per_layer = history.groupby(["step", "layer"]).agg(entropy=("entropy", "min"), score=("max_score_max", "max"))
        axes[0].plot(losses, style, label=f"lr {lr:g}")
        for layer, rows in per_layer.groupby(level="layer"):
            steps = rows.index.get_level_values("step")
            axes[1].plot(steps, rows["entropy"], style, label=f"lr {lr:g}, layer {layer}")
            axes[2].plot(steps, rows["score"], style, label=f"lr {lr:g}, layer {layer}")
        diverged = diverged_at(losses)
        first = alerts.groupby("alert")["step"].min().to_dict() if len(alerts) else {}
        print(
            f"lr {lr:g}: final loss {losses[-1]:.3f}, "
            + (f"diverged at step {diverged}" if diverged is not None else "no divergence")
            + "; first alerts: "
            + (", ".join(f"{k} at step {v}" for k, v in sorted(first.items())) or "none")
        )
    axes[0].set_ylabel("loss")
    axes[1].set_ylabel("lowest head entropy (nats)")
    axes[2].set_ylabel("max attention logit")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
