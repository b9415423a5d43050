"""FLOPs, MFU, memory and throughput; the JSONL / TensorBoard / plot writers; the progress bar.

FLOPs per token (training: forward + backward = 3 x forward), the rule of the PaLM paper's
appendix B and of nanoGPT:

    flops_per_token = 6 * N_matmul + 12 * L * d * T,   d = n_heads * head width

(d is d_model unless model.head_dim sets the head width apart; sliding-window layers are
counted as if they attended to the whole sequence.)

N_matmul counts every weight that takes part in a matmul (the output head included, tied or not;
the embedding lookup and the norms not; in an MoE layer, only the router, the top_k experts a
token visits and the shared experts); the second term is attention's QK^T and AV for a
sequence of T tokens, counted without the causal saving, like the references it is compared to.
MFU = flops_per_token * tokens/s / (peak bf16 FLOP/s of one device * devices).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import jax

from jaxpar.config import ModelConfig
from jaxpar.models.llama import active_matmul_params, attention_layers

# Dense bf16 peak of one device (FLOP/s), matched against `device.device_kind`.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6 * active_matmul_params(cfg) + 12 * attention_layers(cfg) * attention_width(cfg) * seq_len


def attention_width(cfg: ModelConfig) -> int:
    """The d of attention's 12LdT: query heads x head width (d_model unless model.head_dim)."""
    return cfg.n_heads * cfg.head_width


def peak_flops(device: jax.Device) -> float | None:
    """Peak bf16 FLOP/s of `device`, or None where the table has no entry (CPUs)."""
    kind = getattr(device, "device_kind", "")
    for name, peak in PEAK_BF16_FLOPS.items():
        if name.lower() in kind.lower():
            return peak
    return None


def mfu(tokens_per_sec: float, flops_per_tok: float, devices: list[jax.Device]) -> float | None:
    peak = peak_flops(devices[0])
    return None if peak is None else tokens_per_sec * flops_per_tok / (peak * len(devices))


def device_memory_bytes(device: jax.Device) -> int | None:
    """Peak bytes in use on `device`, where the backend reports it (GPUs do, CPUs do not)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats:
        return None
    return stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))


class MetricsWriter:
    """One JSON object per logged step in metrics.jsonl, TensorBoard scalars, and a loss plot
    (the training loss, and eval_loss where a record has it). TensorBoard names: train/KEY,
    eval/loss for eval_loss, train/KEY/NAME for a mapping (tokens_seen per source). Each of
    `sinks` (objects with write(record) and close(): the W&B run, jaxpar.training.wandb_log) gets
    every record written to metrics.jsonl, and is closed with the writer."""

    def __init__(self, run_dir: str, purge_after: int = 0):
        """`purge_after`: the step the run resumed from; TensorBoard hides the earlier session's
        events of later steps (they are rerun), as metrics.jsonl drops its lines."""
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self._tb = None
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            warnings.warn("tensorboardX is not installed: no TensorBoard event files", stacklevel=2)
        else:
            self._tb = SummaryWriter(run_dir, purge_step=purge_after + 1 if purge_after else None)
        self.steps: list[int] = []  # the whole run's curve, earlier sessions' records included
        self.losses: list[float] = []
        self.eval_steps: list[int] = []  # the records that hold an eval_loss
        self.eval_losses: list[float] = []
        self.sinks: list = []  # more writers of each record (see above)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in filter(str.strip, f):
                try:
                    record = json.loads(line)
                    step, loss = record["step"], record["loss"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash (resuming drops it, with a warning)
                self._add(step, loss, record.get("eval_loss"))

    def _add(self, step: int, loss: float, eval_loss: float | None) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        if eval_loss is not None:
            self.eval_steps.append(step)
            self.eval_losses.append(eval_loss)

    def write(self, record: dict) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._add(record["step"], record["loss"], record.get("eval_loss"))
        for sink in self.sinks:
            sink.write(record)
        if self._tb is not None:
            for key, value in record.items():
                if key == "eval_loss" and value is not None:
                    self._tb.add_scalar("eval/loss", value, record["step"])
                elif isinstance(value, dict):
                    for name, v in value.items():
                        self._tb.add_scalar(f"train/{key}/{name}", v, record["step"])
                elif key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])

    def close(self) -> None:
        self._jsonl.close()
        for sink in self.sinks:
            sink.close()
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError:
                self._abandon_tensorboard()
                raise
        if self.steps:
            self.plot()

    def _abandon_tensorboard(self) -> None:
        """After a failed final flush (a full disk): stop tensorboardX's writer threads and mark
        its event writers closed, or its atexit hook flushes again and prints the same ENOSPC as
        a traceback at exit, after the one-line report of the full disk."""
        for file_writer in (self._tb.all_writers or {}).values():
            events = file_writer.event_writer
            worker = getattr(events, "_worker", None)
            if worker is not None and worker.is_alive():
                worker.stop()
            events._closed = True

    def plot(self) -> None:
        # A bare Figure (no pyplot): the caller's matplotlib backend, e.g. a notebook's, is untouched.
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        ax.plot(self.steps, self.losses, label="training loss")
        if self.eval_steps:
            ax.plot(self.eval_steps, self.eval_losses, marker="o", label="eval loss (val split)")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)" if self.eval_steps else "training loss (nats/token)")
        ax.set_title(os.path.basename(os.path.abspath(self.run_dir)))
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(self.run_dir, "loss.png"), dpi=100)


def format_rate(tokens_per_sec: float | None, mfu_value: float | None) -> str:
    """ "12,345 tok/s | MFU 41.2%", with n/a where a number is unknown."""
    tps = "n/a" if tokens_per_sec is None else f"{tokens_per_sec:,.0f}"
    mfu_text = "n/a" if mfu_value is None else f"{100 * mfu_value:.1f}%"
    return f"{tps} tok/s | MFU {mfu_text}"


def format_duration(seconds: float) -> str:
    """12 s, 4 min 05 s, 2 h 03 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """One plain line per logged step (step, loss, eval loss, tokens/s, MFU, time per step, ETA).

    On a terminal the lines are printed above a live bar, so the loss history stays on screen
    when the run ends, as nanoGPT's and torchtitan's logs do; off a terminal (a log file, Slurm,
    nohup) the lines alone, with no carriage returns. The ETA is shown once `TIMED_STEPS` steps
    after the first (which holds the compilation) have been timed: before that it would be a
    guess from the compile time. `enabled=False` prints nothing."""

    TIMED_STEPS = 3

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, stream=None):
        self._stream = sys.stderr if stream is None else stream
        self._total, self._initial, self._enabled = total, initial, enabled
        self._bar = None
        if enabled and self._stream.isatty():
            from tqdm import tqdm

            # tqdm's own rate and ETA are left out: they would count the compiling step.
            self._bar = tqdm(
                total=total,
                initial=initial,
                unit="step",
                dynamic_ncols=True,
                file=self._stream,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )

    def eta(self, step: int, record: dict) -> float | None:
        """Seconds left at the record's time per step; None until enough steps were timed."""
        step_time = record.get("step_time_s")
        if step_time is None or step - self._initial - 1 < self.TIMED_STEPS:
            return None
        return (self._total - step) * step_time

    def line(self, step: int, record: dict) -> str:
        parts = [f"step {step}/{self._total}", f"loss {record['loss']:.4f}"]
        if record.get("eval_loss") is not None:
            parts.append(f"eval loss {record['eval_loss']:.4f}")
        parts.append(format_rate(record["tokens_per_sec"], record["mfu"]))
        if record.get("step_time_s") is not None:
            parts.append(f"{1000 * record['step_time_s']:,.0f} ms/step")
        eta = self.eta(step, record)
        parts.append("ETA " + (format_duration(eta) if eta is not None else "after a few steps"))
        return " | ".join(parts)

    def update(self, step: int, record: dict | None) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
        if record is None or not self._enabled:
            return
        text = self.line(step, record)
        if self._bar is None:
            print(text, file=self._stream, flush=True)
            return
        self._bar.write(text, file=self._stream)
        eta = self.eta(step, record)
        self._bar.set_postfix_str(
            f"loss {record['loss']:.3f} | "
            f"{format_rate(record['tokens_per_sec'], record['mfu'])}"
            + (f" | ETA {format_duration(eta)}" if eta is not None else "")
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
