"""``attnprobe.integrations``: attnprobe inside the engines people already train with.

``AttnprobeCallback`` is a ``transformers.TrainerCallback`` that runs ``attnprobe.monitor`` on the Trainer's
model: attached when training begins, detached when it ends (after a ``train()`` that raised: ``close()``, or the
next ``train()``). ``every`` counts training forward calls (micro-batches under gradient accumulation; evaluation
calls are not counted), from the Trainer's step events, and the sampled steps are numbered by the Trainer's global
step. The capture of a sampled call opens before the model runs, also where accelerate compiles it
(``TrainingArguments(torch_compile=True)``), and records inside the graph. Each time the Trainer logs, the callback
adds per-layer attention figures to what is logged (``attention/layer_03/entropy``: the mean over heads,
``attention/layer_03/entropy_min_head``: the lowest head, ``attention/layer_03/max_score_max``), so they reach
``trainer.state.log_history`` and every reporting callback listed after this one; ``log_dir=`` also writes per-head
TensorBoard scalars itself.
The full per-head table is ``callback.history`` (and ``callback.alerts``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from transformers import TrainerCallback

from .api import monitor

if TYPE_CHECKING:
    from ..probe.analyses.monitor import Monitor


class AttnprobeCallback(TrainerCallback):
    """Attention statistics during ``Trainer.train()``; options as ``attnprobe.monitor``.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=data,
                          callbacks=[attnprobe.integrations.AttnprobeCallback(every=50, alerts={"entropy_below": 0.1})])
        trainer.train()
    """

    def __init__(
        self,
        every: int = 100,
        *,
        rows=64,
        layers=None,
        heads=None,
        log_dir=None,
        alerts=None,
        raise_on=(),
        block_bytes=None,
    ):
        self.options = {
            "every": every,
            "rows": rows,
            "layers": layers,
            "heads": heads,
            "log_dir": log_dir,
            "alerts": alerts,
            "raise_on": raise_on,
            "block_bytes": block_bytes,
        }
        self.monitor: Monitor | None = None
        self._history = None
        self._alerts = None
        self._logged = 0

    # the Trainer's events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        self.close()
        # not a hook on the model: the step events count the training calls (evaluation's are left out), outside
        # any graph (accelerate compiles the model after this call under torch_compile=True)
        self.monitor = monitor(model, **self.options, hook=False, compiled=bool(getattr(args, "torch_compile", False)))
        self.monitor.step = state.global_step
        self._logged = 0

    def on_step_begin(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.step = state.global_step
            self.monitor.begin_call()

    def on_substep_end(self, args, state, control, **kwargs):  # a micro-batch of gradient accumulation ran
        if self.monitor is not None:
            self.monitor.end_call()
            self.monitor.begin_call()

    def on_step_end(self, args, state, control, **kwargs):  # the step's last micro-batch ran
        if self.monitor is not None:
            self.monitor.end_call()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.monitor is None or logs is None:
            return
        figures = self._figures()
        if figures:
            logs.update(figures)
            if state.log_history and isinstance(state.log_history[-1], dict):
                state.log_history[-1].update(figures)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    # results
    def _figures(self) -> dict[str, float]:
        """Per-layer figures of the steps sampled since the last log."""
        if self.monitor is None:
            return {}
        rows = self.monitor.rows[self._logged :]
        self._logged += len(rows)
        if not rows:
            return {}
        out: dict[str, float] = {}
        by_layer: dict[int, list[dict]] = {}
        last = max(r["step"] for r in rows)
        for r in rows:
            if r["step"] == last:
                by_layer.setdefault(r["layer"], []).append(r)
        for layer, heads in sorted(by_layer.items()):
            entropy = [h["entropy"] for h in heads if not math.isnan(h["entropy"])]
            scores = [h["max_score_max"] for h in heads if not math.isnan(h["max_score_max"])]
            name = f"attention/layer_{layer:02d}"
            if entropy:
                out[f"{name}/entropy"] = sum(entropy) / len(entropy)
                out[f"{name}/entropy_min_head"] = min(entropy)
            if scores:
                out[f"{name}/max_score_max"] = max(scores)
        return out

    @property
    def history(self):
        """The monitor's per-head table (kept after training ends)."""
        return self.monitor.history if self.monitor is not None else self._history

    @property
    def alerts(self):
        return self.monitor.alerts if self.monitor is not None else self._alerts

    def close(self) -> None:
        if self.monitor is not None:
            self._history, self._alerts = self.monitor.history, self.monitor.alerts
            self.monitor.close()
            self.monitor = None
