"""Metric sinks beside metrics.jsonl: TensorBoard event files and Weights & Biases (rank 0 only)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpipe_cli.recipe.schema import Metrics, Wandb
from gpipe_cli.records import PIPELINE, TIMING, WARMUP

_NOT_FIGURES = ("kind", "step", "nonfinite", WARMUP, *PIPELINE)  # settings, not curves
WARMUP_SECTION = "train_warmup"


# The curves the HParams tab shows beside each run's recipe values (their latest values).
HPARAM_METRICS = ("train/loss", "train/samples_per_s", "train/mfu", "eval/loss", "eval/accuracy", "eval/bleu",
                  "eval/perplexity")


def hyperparameters(config: dict[str, Any], prefix: str = "") -> dict[str, float | str | bool]:
    """A recipe's values flattened to dotted keys (`model.layers`, `optimizer.lr`); lists and null as text."""
    out: dict[str, float | str | bool] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(hyperparameters(value, f"{prefix}{key}."))
        elif isinstance(value, bool | int | float | str):
            out[f"{prefix}{key}"] = value
        else:  # a list, or null: TensorBoard's hyperparameters are numbers, text or booleans
            out[f"{prefix}{key}"] = "null" if value is None else str(value)
    return out


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A record's numbers as flat tags, per stage for lists, no nulls; a warm-up step's timing in `train_warmup/`."""
    out: dict[str, float] = {}

    def add(tag: str, value: Any) -> None:
        if isinstance(value, bool | int | float):
            out[tag] = float(value)
        elif isinstance(value, list):
            for stage, item in enumerate(value):
                add(f"{tag}/stage{stage}", item)
        elif isinstance(value, dict):
            for key, item in value.items():
                add(f"{tag}/{key}", item)

    warmup = record.get(WARMUP) is True
    for key, value in record.items():
        if key not in _NOT_FIGURES:
            add(f"{WARMUP_SECTION if warmup and key in TIMING else record['kind']}/{key}", value)
    return out


class TensorBoardSink:
    """Event files under RUN_DIR/tensorboard, read by `tensorboard --logdir RUN_DIR`."""

    name = "metrics.tensorboard"
    writes = "TensorBoard"

    def __init__(self, run_dir: Path, first_step: int, config: dict[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        folder = run_dir / "tensorboard"
        folder.mkdir(exist_ok=True)
        try:  # an OSError here, not a traceback in the writer's own thread
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(folder)) from None
        # purge_step hides events a resumed run writes again (those after its checkpoint), as
        # metrics.jsonl drops their lines.
        self._writer = SummaryWriter(log_dir=str(folder),
                                     purge_step=first_step + 1 if first_step else None)
        if config is None:
            return
        import yaml
        from torch.utils.tensorboard.summary import hparams

        # The resolved recipe as a text summary (`recipe`), and its values as hyperparameters (HParams tab).
        # Markdown: indented by four spaces, the YAML shows as a code block with its indentation kept.
        text = "".join(f"    {line}\n" for line in yaml.safe_dump(config, sort_keys=False).splitlines())
        self._writer.add_text("recipe", text, global_step=first_step)
        # Into this event file, not add_hparams' own sub-run, so the HParams tab links the run's own curves.
        for summary in hparams(hyperparameters(config), dict.fromkeys(HPARAM_METRICS, 0.0)):
            self._writer._get_file_writer().add_summary(summary, first_step)
        self._writer.flush()

    def log(self, values: dict[str, float], step: int) -> None:
        """Write one record's scalars and flush, so a running TensorBoard sees the step at once."""
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Close the event file."""
        self._writer.close()


class WandbSink:
    """A Weights & Biases run; offline mode writes RUN_DIR/wandb/offline-run-* for `wandb sync`."""

    name = "metrics.wandb"
    writes = "W&B"

    def __init__(self, run_dir: Path, options: Wandb, config: dict[str, Any]) -> None:
        # wandb's own chatter (login, sync hints) would break the live view; failures are our one line.
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb
        # A bounded wait: with no network, online mode fails at start instead of stalling the run.
        settings = wandb.Settings(silent=True, init_timeout=30, console="off")
        self._run = wandb.init(project=options.project, entity=options.entity, mode=options.mode, dir=str(run_dir),
                               name=options.name or run_dir.name, group=options.group,
                               tags=list(options.tags) or None, config=config, settings=settings)

    def log_model(self, path: Path) -> None:
        """Log an exported model file as the run's `model` artifact."""
        artifact = self._wandb.Artifact(name=f"model-{self._run.id}", type="model")
        artifact.add_file(str(path))
        self._run.log_artifact(artifact)

    def log(self, values: dict[str, float], step: int) -> None:
        """Log one record's scalars at its step."""
        self._run.log(values, step=step)

    def close(self) -> None:
        """Finish the run (offline: its folder is complete)."""
        self._run.finish()


Sink = TensorBoardSink | WandbSink


def _start(name: str, make: Callable[[], Sink], hint: str) -> Sink | str:
    """The started sink, or why it could not start (what is written instead is said once all have started)."""
    try:
        return make()
    except ImportError as err:
        return f"{name}: {err.name or 'a package'} is not installed ({hint})"
    except Exception as err:  # noqa: BLE001 - whatever a logging service raises, training goes on
        return f"{name}: could not start ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"


class Sinks:
    """The enabled sinks; a sink that raises is closed and dropped with one line."""

    def __init__(self, sinks: list[Sink], say: Callable[[str], None]) -> None:
        self.sinks, self._say = sinks, say

    def write(self, record: Mapping[str, Any]) -> None:
        """Send one train or eval record (already free of NaN) to every sink."""
        values, step = scalars(record), int(record["step"])
        self._each(lambda sink: sink.log(values, step), "stopped logging", drop=True)

    def takes_models(self) -> bool:
        """Whether a running sink logs model files (W&B's artifacts)."""
        return any(hasattr(sink, "log_model") for sink in self.sinks)

    def log_model(self, path: Path) -> None:
        """Hand an exported model file to every sink that logs models; a failure (of the upload only) is one line."""
        self._each(lambda sink: sink.log_model(path) if hasattr(sink, "log_model") else None,
                   f"could not log {path.name}")

    def close(self) -> None:
        """Close every sink; a failure to close is one line."""
        self._each(lambda sink: sink.close(), "could not close")
        self.sinks = []

    def _each(self, act: Callable[[Any], object], failed: str, drop: bool = False) -> None:
        """Do `act` to every sink; one that raises says `failed` in one line (`drop`: and is dropped)."""
        for sink in list(self.sinks):
            try:
                act(sink)
            except Exception as err:  # noqa: BLE001 - a failing sink must not end the run
                self._say(f"{sink.name}: {failed} ({type(err).__name__}: {err})"
                          + ("; metrics.jsonl goes on" if drop else ""))
                if drop:
                    self.sinks.remove(sink)


def open_sinks(metrics: Metrics, run_dir: Path, first_step: int, config: dict[str, Any],
               say: Callable[[str], None]) -> Sinks:
    """Start the sinks the recipe's `metrics:` section enables; each that cannot start says so in one line."""
    started: list[Sink | str] = []
    if metrics.tensorboard:
        started.append(_start(TensorBoardSink.name, lambda: TensorBoardSink(run_dir, first_step, config),
                              "pip install 'gpipe-cli[tensorboard]'"))
    wandb = metrics.wandb
    if wandb is not None:
        started.append(_start(WandbSink.name, lambda: WandbSink(run_dir, wandb, config),
                              "pip install 'gpipe-cli[wandb]'"))
    sinks = [s for s in started if not isinstance(s, str)]
    # A sink that failed says what the run still writes: the other sink may well be running.
    written = " and ".join(["metrics.jsonl", *(s.writes for s in sinks)]) if sinks else "metrics.jsonl only"
    for failed in (s for s in started if isinstance(s, str)):
        say(f"{failed}; writing {written}")
    return Sinks(sinks, say)
