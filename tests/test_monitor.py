"""attnprobe.monitor and the Trainer callback: statistics every N steps, untouched training, alerts, TensorBoard."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import attnprobe
from attnprobe.probe.analyses.monitor import AttentionAlert, Monitor, MonitorError, per_head_rows


class Tiny(nn.Module):
    """Two causal layers of attnprobe's own attention with dropout, and a head to train."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(
            attnprobe.MultiHeadAttention(16, num_heads=4, causal=True, dropout=dropout) for _ in range(2)
        )
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, 50)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + self.drop(layer(x))
        return self.head(x)


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (2, 12), generator=g) for _ in range(n)]


def train(model, data, make_monitor=None):
    """Train a few steps; return (losses, final parameters, the RNG state after, the monitor)."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = make_monitor(model) if make_monitor else None
    losses = []
    try:
        for ids in data:
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    finally:
        if mon is not None:
            mon.close()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], torch.get_rng_state(), mon


def test_training_is_bitwise_the_same_and_only_every_nth_call_is_sampled(assert_no_hooks):
    data = batches(10)
    torch.manual_seed(1)
    plain_model = Tiny().train()
    watched_model = Tiny().train()
    watched_model.load_state_dict(plain_model.state_dict())
    plain = train(plain_model, data)
    watched = train(watched_model, data, lambda m: attnprobe.monitor(m, every=3))
    assert torch.equal(plain[0], watched[0])  # losses: dropout masks and forwards identical
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1]))  # the same gradients, steps, weights
    assert torch.equal(plain[2], watched[2])  # the random stream: not one draw more
    mon = watched[3]
    history = mon.history
    assert sorted(history["step"].unique()) == [0, 3, 6, 9] and len(history) == 4 * 2 * 4
    assert {"entropy", "entropy_min", "max_score_max", "max_weight_max", "nonfinite_rows"} <= set(history.columns)
    assert (history["nonfinite_rows"] == 0).all() and history["entropy"].between(0, math.log(12)).all()
    assert_no_hooks(watched_model)


def test_sampled_values_equal_a_statistics_capture_of_the_same_call():
    model = Tiny(dropout=0.0).eval()
    ids = batches(1)[0]
    with attnprobe.monitor(model, every=1) as mon, torch.no_grad():
        model(ids)
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as cap:
        model(ids)
    expected = per_head_rows(cap, step=0, call=0)
    assert list(mon.rows) == expected and len(expected) == 8


def test_nothing_is_captured_between_sampled_calls():
    entered = []

    def counting_capture(model, **options):
        session = attnprobe.capture(model, **options)
        enter = session.__enter__

        def counted():
            entered.append(1)
            return enter()

        session.__enter__ = counted
        return session

    model = Tiny(dropout=0.0).eval()
    with Monitor(counting_capture, model, every=4) as mon, torch.no_grad():
        for ids in batches(9):
            model(ids)
    assert len(entered) == 3 and sorted(mon.history["step"].unique()) == [0, 4, 8]


def test_no_hook_left_when_the_training_loop_raises_on_a_sampled_step(assert_no_hooks):
    model = Tiny(dropout=0.0)
    with pytest.raises(IndexError):  # noqa: PT012  (an error raised through the monitor's exit)
        with attnprobe.monitor(model, every=2):
            model(batches(1)[0])
            model(batches(1)[0])
            model(torch.tensor([[1, 500]]))  # a sampled call whose forward raises (500 outside the vocabulary)
    assert_no_hooks(model)
    mon = attnprobe.monitor(model, every=1)
    mon.close()
    mon.close()  # twice is fine
    assert_no_hooks(model)


def test_a_monitor_the_loop_drives_counts_its_calls_and_closes_an_open_capture(assert_no_hooks):
    """hook=False: no hook on the model; begin_call counts a call and opens a capture where it is sampled, end_call
    records it. A loop that raised between them leaves a capture open: close() takes it and its hooks away."""
    model = Tiny(dropout=0.0).eval()
    data = batches(5)
    with torch.no_grad(), attnprobe.monitor(model, every=2) as hooked:
        for ids in data:
            model(ids)
    mon = attnprobe.monitor(model, every=2, hook=False)
    assert not model._forward_pre_hooks and mon.driven
    with torch.no_grad():
        for ids in data:
            model(ids)  # not counted: nothing on the model counts
            mon.begin_call()
            model(ids)
            mon.end_call()
    assert mon.calls == 5
    import pandas as pd

    pd.testing.assert_frame_equal(mon.history, hooked.history)  # calls 0, 2, 4: the same statistics
    mon.begin_call()  # call 5, not sampled
    mon.begin_call()  # call 6, sampled: a capture opens and its forward raises
    with pytest.raises(IndexError):
        model(torch.tensor([[1, 500]]))
    assert model.layers[0]._forward_hooks or model.layers[0]._forward_pre_hooks
    mon.close()
    assert_no_hooks(model)
    assert len(mon.history) == 3 * 2 * 4 and "closed" in repr(mon)
    with pytest.raises(MonitorError, match="closed"):
        mon.begin_call()
    with pytest.raises(MonitorError, match="hook=False"):
        hooked.begin_call()


def test_alerts_warn_once_per_head_are_kept_and_can_raise():
    model = Tiny(dropout=0.0).eval()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with attnprobe.monitor(model, every=1, alerts={"entropy_below": 10.0, "nonfinite": True}) as mon:
            for ids in batches(3):
                model(ids)
    messages = [str(w.message) for w in caught if issubclass(w.category, attnprobe.AttnprobeWarning)]
    assert len(messages) == 8  # once per (layer, head, alert), not once per step
    assert messages[0].startswith("attnprobe alert entropy_below at step 0: layer 0 head 0 entropy = ")
    alerts = mon.alerts
    assert len(alerts) == 3 * 8 and set(alerts["alert"]) == {"entropy_below"}
    with pytest.raises(AttentionAlert, match=r"max_score_above at step 0: layer 0 head 0 max_score_max = "):
        with attnprobe.monitor(model, every=1, alerts={"max_score_above": -1e9}, raise_on=["max_score_above"]):
            model(batches(1)[0])
    with pytest.raises(MonitorError, match="no alert 'entropy_under'"):
        attnprobe.monitor(model, alerts={"entropy_under": 1.0})
    with pytest.raises(MonitorError, match="every must be a positive whole number"):
        attnprobe.monitor(model, every=0)
    with pytest.raises(attnprobe.SelectionError):
        attnprobe.monitor(model, layers=[7])  # refused before training starts, not at the first sampled step


def test_history_to_parquet_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = Tiny(dropout=0.0).eval()
    with attnprobe.monitor(model, every=2, log_dir=tmp_path / "tb") as mon, torch.no_grad():
        for ids in batches(5):
            model(ids)
    assert mon.to_parquet(tmp_path / "history.parquet") == tmp_path / "history.parquet"
    import pandas as pd

    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "history.parquet"), mon.history)
    with pytest.raises(FileExistsError, match="overwrite=True"):  # the history written before is kept
        mon.to_parquet(tmp_path / "history.parquet")
    mon.to_parquet(tmp_path / "history.parquet", overwrite=True)
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        mon.to_parquet(tmp_path / "missing" / "history.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.parquet", "tb"]  # no temporary file left
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tag = "attention/layer 01/head 03/entropy"
    assert tag in events.Tags()["scalars"]
    values = events.Scalars(tag)
    assert [e.step for e in values] == [0, 2, 4]
    expected = mon.history.query("layer == 1 and head == 3")["entropy"].tolist()
    assert [e.value for e in values] == pytest.approx(expected, rel=1e-6)


def _gpt2_trainer(tmp_path, callback, steps: int, **args):
    """(a tiny GPT-2, a Trainer of it for ``steps`` steps on the CPU with ``callback``; ``args``: more
    TrainingArguments; with an ``eval_strategy``, four of the training batches are its evaluation set)."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=32))
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in batches(2 * steps)]
    settings = dict(report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, **args)
    training = TrainingArguments(str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=2, **settings)
    evaluation = data[:4] if "eval_strategy" in args else None
    return model, Trainer(model=model, args=training, train_dataset=data, eval_dataset=evaluation, callbacks=[callback])


def test_trainer_callback_logs_through_the_trainer(tmp_path, assert_no_hooks):
    callback = attnprobe.integrations.AttnprobeCallback(every=2)
    model, trainer = _gpt2_trainer(tmp_path, callback, 6, logging_steps=2)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "attention/layer_00/entropy" in entry]
    assert len(logged) == 3, trainer.state.log_history
    assert all(
        {"attention/layer_01/entropy_min_head", "attention/layer_01/max_score_max", "loss"} <= set(e) for e in logged
    )
    history = callback.history
    assert sorted(history["step"].unique()) == [0, 2, 4]  # every 2nd forward call, numbered by global step
    assert len(history) == 3 * 2 * 4
    assert_no_hooks(model)


def _train(trainer) -> list[str]:
    """Run ``trainer.train()``; the attnprobe warnings it gave. Skips where torch cannot compile the model (before
    2.7, transformers' models do not compile)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            trainer.train()
        except Exception as exc:
            if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7):
                raise
            pytest.skip(f"torch {torch.__version__} cannot compile transformers' models ({type(exc).__name__})")
    return [str(w.message) for w in seen if issubclass(w.category, attnprobe.AttnprobeWarning)]


def test_trainer_callback_monitors_a_model_the_trainer_compiles(tmp_path, assert_no_hooks):
    """TrainingArguments(torch_compile=True): accelerate compiles the model after the Trainer hands it to callbacks,
    so a hook on the model would run inside the graph and sample nothing. The callback counts the training forward
    calls from the Trainer's step events instead and opens each sampled call's capture before the graph: the same
    sampled steps and statistics as the eager Trainer, the same trained weights as the compiled Trainer without it,
    and no warning. With gradient accumulation (two micro-batches a step here), ``every`` counts micro-batches, as
    the eager monitor counts calls."""
    import torch._dynamo

    args = dict(torch_compile_backend="eager", gradient_accumulation_steps=2, seed=0)
    eager_cb = attnprobe.integrations.AttnprobeCallback(every=2)
    _, eager = _gpt2_trainer(tmp_path / "eager", eager_cb, 4, **args)
    assert _train(eager) == []
    torch._dynamo.reset()
    bare_model, bare = _gpt2_trainer(tmp_path / "bare", transformers_callback(), 4, torch_compile=True, **args)
    _train(bare)
    torch._dynamo.reset()
    callback = attnprobe.integrations.AttnprobeCallback(every=2)
    model, compiled = _gpt2_trainer(tmp_path / "compiled", callback, 4, torch_compile=True, **args)
    assert _train(compiled) == []
    # calls 0, 2, 4, 6 of 8: each step's first micro-batch
    assert sorted(callback.history["step"].unique()) == sorted(eager_cb.history["step"].unique()) == [0, 1, 2, 3]
    columns = ["step", "layer", "head", "rows", "entropy", "entropy_min", "max_weight_max", "max_score_max"]
    import pandas as pd

    pd.testing.assert_frame_equal(
        callback.history[columns], eager_cb.history[columns], check_exact=False, rtol=1e-5, atol=1e-6
    )
    for name, value in model.state_dict().items():  # the monitor changed nothing of the compiled training
        assert torch.equal(value, bare_model.state_dict()[name]), name
    assert_no_hooks(model)


def transformers_callback():
    from transformers import TrainerCallback

    return TrainerCallback()


def test_trainer_callback_samples_a_model_compiled_in_place(tmp_path, assert_no_hooks):
    """``model.compile()`` before the Trainer: a hook on the model would run inside the graph. The callback puts none
    there; the step events count the calls, and the capture (which finds the compiled module) records inside."""
    callback = attnprobe.integrations.AttnprobeCallback(every=2)
    model, trainer = _gpt2_trainer(tmp_path, callback, 5)
    model.compile(backend="eager")
    said = _train(trainer)
    assert said == [], said
    assert sorted(callback.history["step"].unique()) == [0, 2, 4]
    assert_no_hooks(model)


def test_trainer_callback_counts_training_calls_not_evaluation_calls(tmp_path):
    """Evaluation between training steps runs the model too (in eval mode): those calls are neither counted nor
    sampled, so ``every`` keeps its training steps and the history holds training statistics only. (With a hook on
    the model, calls 0, 2, 4, ... fell on evaluation batches too, labelled as training steps 1, 3, 5.)"""
    callback = attnprobe.integrations.AttnprobeCallback(every=2)
    _, trainer = _gpt2_trainer(tmp_path, callback, 6, eval_strategy="steps", eval_steps=2)
    trainer.train()
    assert len([e for e in trainer.state.log_history if "eval_loss" in e]) == 3  # evaluation did run
    assert sorted(callback.history["step"].unique()) == [0, 2, 4] and len(callback.history) == 3 * 2 * 4


def test_monitor_plot_draws_one_line_per_layer_or_head():
    from matplotlib.figure import Figure

    model = Tiny(dropout=0.0).eval()
    with attnprobe.monitor(model, every=2) as mon, torch.no_grad():
        for ids in batches(6):
            model(ids)
    history = mon.history
    ax = attnprobe.reports.monitor_plot(history, ax=Figure().add_subplot())
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["layer 0", "layer 1"]
    assert list(lines[1].get_xdata()) == [0, 2, 4]
    expected = history[history["layer"] == 1].groupby("step")["entropy_min"].min().tolist()
    assert list(lines[1].get_ydata()) == pytest.approx(expected)
    per_head = attnprobe.reports.monitor_plot(history, "max_score_max", by="head", ax=Figure().add_subplot())
    assert len(per_head.get_lines()) == 8
    with pytest.raises(ValueError, match="no statistic 'loss'"):
        attnprobe.reports.monitor_plot(history, "loss")
    with pytest.raises(TypeError, match=r"mon\.history"):
        attnprobe.reports.monitor_plot(mon)


def test_history_keeps_about_eight_bytes_a_value_not_a_dict_per_row():
    """Resident memory grows as the history frame does: the rows are kept by column, not as one dict each."""
    import tracemalloc

    from attnprobe.probe.analyses.monitor import COLUMNS, History

    history = History()
    template = dict.fromkeys(COLUMNS, 0) | {"module": "layers.0"}
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(20_000):
        history.append({**template, "step": i, "entropy": i * 0.5, "module": f"layers.{i % 2}"})
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 20_000 * (8 * len(COLUMNS)) * 1.5, grown  # a dict per row: about 0.8 KB each
    assert len(history) == 20_000 and history[-1]["step"] == 19_999 and history[3]["entropy"] == 1.5
    assert [r["step"] for r in history[5:8]] == [5, 6, 7] and history[0]["module"] == "layers.0"
    frame = history.frame()
    assert list(frame.columns) == list(COLUMNS) and frame["step"].dtype == "int64" and len(frame) == 20_000


def test_the_hooks_a_sampled_capture_puts_on_the_monitored_model_see_that_call():
    """The monitor opens a sampled step's capture inside the model's own forward pre-hook, and torch calls only the
    hooks a module had when its call began: the capture's own pre-hooks on that model (a Hugging Face stack's reading
    of its padding mask) missed the call, so a bare LlamaModel's left padding went unseen and the history counted
    padded rows as real (14 rows where the batch has 12 tokens). The monitor runs them itself; the capture closes
    after its own post-hooks ran. The gradients are those of a run without the monitor."""
    pytest.importorskip("transformers")
    from hf_helpers import build, inputs

    batch = inputs("llama", "left")  # (2, 7): two padded positions, 12 real tokens
    grads = []
    for monitored in (False, True):
        model = build("llama").model.train()  # the bare LlamaModel
        monitor = attnprobe.monitor(model, every=1, rows=None) if monitored else None
        model(**batch).last_hidden_state.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if monitor is not None:
            monitor.close()
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert monitor.history["rows"].tolist() == [12] * 8  # each of two layers' four heads: the real rows only
