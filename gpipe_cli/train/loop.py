"""The training loop every rank runs: build this rank's stage, then train, evaluate and report."""

from __future__ import annotations

import itertools
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gpipe_cli import memory_model as mm
from gpipe_cli import sizing
from gpipe_cli.data import Batch, Loader, build_data_for
from gpipe_cli.data.sources import held_out_files
from gpipe_cli.errors import NONFINITE_EXIT_CODE, DataError, UserError, path_line
from gpipe_cli.estimate import cost_cache
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline import heartbeat, schedules, topology
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layer_profile import profile_layers
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.partition import stage_layers, stage_ranges
from gpipe_cli.pipeline.step import PendingStep
from gpipe_cli.recipe.schema import LOCAL_SOURCES, Recipe, TransformerModel, nothing_held_out
from gpipe_cli.recipe_model import build_optimizer, model_spec, optimizer_name, pipeline_config
from gpipe_cli.records import EvalRecord, TrainRecord
from gpipe_cli.runs import CHECKPOINTS, candidates, is_checkpoint, run_dir_of
from gpipe_cli.train import checkpoint, cut, evaluation, nonfinite, optim, output
from gpipe_cli.train.existing import (
    choose_run_dir,
    complete_line,
    continue_command,
    earlier_checkpoint,
    evaluation_missing,
    fork_of,
    past_end,
    recipe_bytes,
    save_recipe,
    way_on,
)
from gpipe_cli.train.export import export as export_model
from gpipe_cli.train.plan import Plan, make_plan, microbatch_size
from gpipe_cli.train.profiling import StepProfiler
from gpipe_cli.train.resume import (
    Checkpointer,
    data_change,
    eval_cut_changed,
    rewind,
    saved_cut,
    skipped_until,
    split_rule_changed,
)
from gpipe_cli.train.signals import AFTER_STEP, StopRequest, answers_stops
from gpipe_cli.train.sinks import open_sinks
from gpipe_cli.train.step_figures import ModelFlops, Peak, find_peak, step_figures, utilization_of
from gpipe_cli.train.summary import RunSummary, eval_figures
from gpipe_cli.train.view import MetricsFile, TerminalView
from gpipe_cli.train.worker import Job
from gpipe_cli.units import counted, number_range


class Trainer:
    """One rank's part of a training run."""

    def __init__(self, recipe: Recipe, job: Job, topo: topology.Topology) -> None:
        self.recipe, self.job, self.topo, self.layout = recipe, job, topo, topo.layout
        self.view = (TerminalView(recipe.name, job.plain, started=job.started) if self.layout.rank == 0 else None)
        self._note(f"{counted(self.layout.world_size, 'rank')} started on "
                   f"{topo.device.type}; planning the cut")
        self.spec: ModelSpec = model_spec(recipe)
        self.plan: Plan = self._plan()
        chosen = job.run_dir or (run_dir_of(job.resume) if job.resume else choose_run_dir(recipe, job.output_dir))
        self.run_dir = Path(self.topo.share(str(chosen) if self.layout.rank == 0 else None))
        fresh = job.run_dir is not None or not self.run_dir.exists()  # made for this run by its launcher, or not yet
        try:
            self._build()
        except BaseException:
            if self.layout.rank == 0 and fresh:  # a run that never started leaves nothing behind
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    def _build(self) -> None:
        recipe, job, topo = self.recipe, self.job, self.topo
        self.data: Loader | None = None
        self._note(self._reading_data())
        if self.layout.is_first or self.layout.is_last:
            # The tokenizer's vocabulary is checked against model.vocab_size as it is loaded (tokenizer.load_or_train).
            self.data = build_data_for(recipe, run_dir=self.run_dir)
        counts = ((self.data.steps_per_epoch(), self.data.eval_steps(recipe.eval.batches), self.data.train.held_none)
                  if self.data else None)
        self.steps_per_epoch, self.eval_steps, self.held_none = self.topo.share(counts)
        if recipe.eval.every and not self.eval_steps:  # every rank alike: the counts are shared
            # Too few records for any fraction to hold one out: raising it would not help.
            why = (f": {self.held_none}" if self.held_none else
                   f" (data.eval_fraction {recipe.data.eval_fraction:g}, data.eval_split "
                   f"{recipe.data.eval_split or 'null'}); raise data.eval_fraction")
            raise UserError(nothing_held_out(recipe.eval.every, why))
        if self.data is not None:
            self._note(self._data_summary(self.data))
        if self.layout.rank == 0:
            (self.run_dir / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
        k = recipe.pipeline.partitions
        self._note(f"building {counted(k, 'stage')} of {self.spec.name} "
                   f"({self.plan.total_params:,} parameters): {self._cut_text()}")
        self.pipe = self._pipeline()
        self._check_cut()
        train = recipe.train
        self.total_steps = optim.total_steps(train.steps, train.epochs, self.steps_per_epoch)
        self.optimizer = build_optimizer(self.pipe.parameters(), recipe)
        self.lr = optim.lr_factor(recipe, self.steps_per_epoch, self.total_steps)
        self.scheduler = optim.following(self.optimizer, self.lr)  # one function: the records say what trains
        data = self.data
        read: dict[str, int | str] = {}
        if data is not None:
            read = {"train_examples": data.train_size, "held_out": data.eval_size, "held_out_batches": "any size"}
            if data.eval is not None and data.eval.by_content:
                read["held_out_by"] = "content"
        self.checkpoints = Checkpointer(self.pipe, self.optimizer, self.scheduler, topo, self.plan, self.run_dir,
                                        recipe.checkpoint.keep, recipe_bytes(recipe), read)
        if job.resume:
            named = is_checkpoint(Path(str(job.resume)))  # a checkpoint's own folder, not its run's
            self._note(f"loading {'checkpoint' if named else 'the newest whole checkpoint of'} {path_line(job.resume)}")
        self.start_step = self._resume() if job.resume else 0
        self.complete = job.resume is not None and self.start_step == self.total_steps
        self.missed_eval = bool(job.resume) and self._missed_eval()
        if self.complete and not self.missed_eval:  # a finished run resumed again (a requeued job): nothing to do
            return
        if self.layout.rank == 0:
            # No rank saves before rank 0 reaches its first save, so no partial folder removed here is being written.
            for stale in checkpoint.remove_partials(self.run_dir):
                self._note(f"removed {stale}, a checkpoint whose save never finished")
            if not job.resume:  # a resume's settings are recorded once it goes on (`_going_on`)
                save_recipe(recipe, self.run_dir)
        self.stop = StopRequest(announce=answers_stops(self.layout.rank))
        self.stop.way_on = lambda: way_on(self.run_dir)
        self.stopped_by = 0
        self.policy = nonfinite.NonFinitePolicy(recipe.train.on_nonfinite, recipe.train.max_skipped,
                                                loss_scaling=recipe.train.precision == "fp16")
        if job.resume:
            self.policy.consecutive, self.policy.total = self.skipped_before
        self.diverged: str | None = None  # the line that ends a run on non-finite values
        self.metrics = (MetricsFile(self.run_dir / "metrics.jsonl",
                                    open_sinks(recipe.metrics, self.run_dir, self.start_step,
                                               recipe.model_dump(mode="json"), self._note))
                        if self.layout.rank == 0 else None)
        chosen = recipe.pipeline.schedule
        self.summary = RunSummary(self.total_steps, job.started or time.time(),
                                  formula=schedules.get(chosen).bubble_formula or f"of {chosen}")
        if self.metrics is not None:
            self.summary.take_earlier(self.metrics.path, self.start_step)
        self.model_flops, self.peak = self._utilization() if self.layout.rank == 0 else (None, None)
        self.profiler = StepProfiler(recipe.train.profile, self.run_dir, self.layout.rank, topo.device,
                                     self.total_steps)

    # ----------------------------------------------------------------- set-up helpers

    def _cut_text(self) -> str:
        ranges = stage_ranges(self.plan.balance)  # one per chunk, placed as the layout says
        by = self.plan.balance_by  # what chose the cut
        return (", ".join(f"stage {self.layout.owner(i)} layer{'s' if len(r) > 1 else ''} {number_range(r[0], r[-1])}"
                          for i, r in enumerate(ranges)) + (f" ({by})" if by == "the only cut" else f" (cut by {by})"))

    def _pipeline(self) -> Pipeline:
        """This rank's stage as the plan cuts it, its layers built afresh from their seeds."""
        recipe, topo = self.recipe, self.topo
        span = stage_layers(self.plan.balance, recipe.pipeline.partitions, self.layout.stage, self.layout.placement)
        layers = build_layers(self.spec.factories(), span, recipe.seed, topo.device)
        return Pipeline(layers, topo, pipeline_config(recipe, self.plan.balance), self.spec.loss,
                        units=self.spec.units, tied=self.spec.tied, precision=recipe.train.precision)

    def _check_cut(self) -> None:
        """Time untrained steps of the stages and cut again where their compute differs (see cut.py)."""
        pipe_cfg, costs = self.recipe.pipeline, self._costs
        wanted = (costs is not None and self.plan.balance_by.startswith("measured time")
                  and pipe_cfg.virtual_stages == 1 and cut.worth_checking(costs, self.plan.balance,
                                                                          pipe_cfg.microbatches))
        if not self.topo.share(wanted if self.layout.rank == 0 else None):
            return
        self._note(f"timing {cut.TRIAL_STEPS} untrained steps of the stages to check the cut")
        measured = self._stage_compute()
        decided: Plan | None = None
        trial: Plan | None = None
        if self.layout.rank == 0 and measured is not None and costs is not None:
            text = f"the stages computed {cut.describe(measured)} a step"
            if cut.imbalance(measured) <= cut.TOLERANCE:
                text += f", within {cut.TOLERANCE:.0%} of each other: the cut stands"
            else:
                refined = cut.refined_costs(costs, self.plan.balance, measured)
                plan = self._plan_or_none(refined, None)
                if plan is not None and cut.better(refined, self.plan.balance, plan.balance):
                    decided = plan
                    text += "; cut again"
                else:
                    nearby = cut.shifted(self.plan.balance, measured)
                    trial = self._plan_or_none(None, nearby) if nearby is not None else None
                    text += (f"; timing the cut {trial.balance} too" if trial is not None else
                             "; no other cut makes the slowest stage faster")
            self._note(text)
        decided = self.topo.share(decided) or self._timed(self.topo.share(trial), measured)
        if decided is not None:
            self.plan = decided
            self._note(f"stages: {self._cut_text()}")
        # Fresh layers: the trial steps accumulated gradients and committed BatchNorm statistics.
        del self.pipe
        self.pipe = self._pipeline()

    def _stage_compute(self) -> list[float] | None:
        """Every stage's compute per step in untrained trial steps of the pipeline as it is cut now (rank 0)."""
        # The loader's heaviest batch, not data.batch_size examples of model.max_len: a token budget packs far fewer.
        batch = self.data.heaviest_batch(shard=(self.layout.replica, self.layout.replicas),
                                         need_inputs=self.layout.is_first, need_targets=self.layout.is_last) \
            if self.data is not None else None
        return cut.stage_compute(self.pipe, batch, self.recipe.pipeline.microbatches, self.recipe.seed)

    def _plan_or_none(self, costs: list[float] | None, balance: list[int] | None) -> Plan | None:
        """The plan cut by `costs` (or as `balance`) after the trial steps, if every stage of it fits."""
        by = f"{self.plan.balance_by}, " + ("corrected by the stages' compute" if balance is None else
                                             "checked by trial steps")
        try:
            plan = make_plan(self.recipe, self.spec, costs, available=self.job.available, measured_by=by,
                             chosen=None if balance is None else (balance, by))
        except UserError:
            return None
        return plan if plan.fits else None

    def _timed(self, trial: Plan | None, measured: list[float] | None) -> Plan | None:
        """`trial` if its trial steps' slowest stage computes less than the current cut's (`measured`), else None."""
        if trial is None:
            return None
        current, self.plan = self.plan, trial
        del self.pipe
        self.pipe = self._pipeline()
        again = self._stage_compute()
        keep = None
        if self.layout.rank == 0 and again is not None and measured is not None:
            keep = max(again) < max(measured)
            self._note(f"with the cut {trial.balance} the stages computed {cut.describe(again)} a step: "
                       + ("it is kept" if keep else f"the cut {current.balance} stands"))
        self.plan = trial if self.topo.share(keep) else current
        return None if self.plan is current else trial

    def _note(self, text: str) -> None:
        """A preparation step on the launching terminal (rank 0), so the screen is never blank."""
        if self.view is not None:
            self.view.note(text)

    def _utilization(self) -> tuple[ModelFlops | None, Peak | None]:
        """The model FLOPs of a step and the peak MFU is measured against (rank 0), said in one line."""
        forward = float(sum(stage.flops for stage in self.plan.stages))
        if forward <= 0:
            self._note("MFU: no FLOP count for this model; records carry no tflops or mfu")
            return None, None
        units = None
        if self.spec.task != "image":  # text: FLOPs per token, as a step's batch holds any number of tokens
            units = self.spec.example_batch(1, "meta")[1].numel()
        device, train = self.topo.device, self.recipe.train
        threads = torch.get_num_threads()
        peak = find_peak(train.peak_tflops, device.type, train.precision, lambda: torch.cuda.get_device_name(device),
                         lambda: cost_cache.best_rate(sizing.measured_rate("cpu", threads, fastest=True), threads))
        self.summary.peak, self.summary.ranks = peak, self.layout.world_size
        self._note(f"MFU: model FLOPs (3x forward, recomputation not counted) over {peak.source}")
        return ModelFlops(forward, units), peak

    def _reading_data(self) -> str:
        data, model = self.recipe.data, self.recipe.model
        where = data.path if data.source in LOCAL_SOURCES else data.name if data.source == "hub" else None
        held_out = data.eval_split if where is None else None  # data read from nowhere holds out eval_fraction
        unread = [key for key, value in (("data.name", data.name), ("data.path", data.path),
                                         ("data.eval_split", held_out))
                  if value and value != where]  # e.g. a CPU run's `--set data.source=synthetic` over a real recipe
        text = f"reading data ({data.source}{f': {where}' if where else ''}" + (
            f"; {' and '.join(unread)} not read by {data.source} data)" if unread else ")")
        stored = (self.run_dir / "tokenizer.model").exists()
        if isinstance(model, TransformerModel) and not data.tokenizer and not stored:
            text += f" and training the tokenizer (vocabulary {data.vocab_size or model.vocab_size})"
            if self.job.resume:  # the checkpoint's embedding was trained on the lost one's pieces
                text += (": the run's tokenizer.model is missing; a new one has the same pieces only if the training "
                         "text is unchanged")
        return text

    def _data_summary(self, data: Loader) -> str:
        """How much data there is and what `drop_last` leaves out of every epoch."""
        used = sum(len(batch) for batch in data.plan(0))
        model, given = self.recipe.model, self.recipe.data
        # A folder's files or folder named as a split: which, as the name may mislead.
        held = held_out_files(given) or (data.eval.origin if data.eval is not None else None)
        text = (f"data: {counted(data.train_size, 'training example')}, {counted(self.steps_per_epoch, 'step')} per "
                f"epoch, {data.eval_size:,} held out" + (f" ({held})" if held else ""))
        dropped = data.train_size - used
        wanted = given.vocab_size or (model.vocab_size if isinstance(model, TransformerModel) else None)
        pieces = data.tokenizer.vocab_size if data.tokenizer is not None and not given.tokenizer else None
        if pieces is not None and wanted and pieces < wanted:  # sentencepiece's soft limit on a small corpus
            text += (f"; the tokenizer has {pieces:,} pieces, fewer than the {wanted:,} asked: the "
                     "training text holds no more")
        text += "".join(f"; {split.left_out}" for split in (data.train, data.eval)
                       if split is not None and split.left_out)
        labels = getattr(data.train, "labels", None)  # an image model's: more outputs than classes go unnamed
        classes = getattr(model, "num_classes", 0)
        if labels is not None and given.source != "synthetic" and 0 < (found := len(set(labels.tolist()))) < classes:
            text += (f"; the training data holds {found} of the model's {classes} classes (model.num_classes): it "
                     f"never learns to answer the other{'s' * (classes - found > 1)}")
        if dropped:
            text += (f"; data.drop_last leaves out {dropped:,} of {data.train_size:,} training examples per epoch "
                     f"(a partial last batch; data.drop_last: false keeps them)")
        if data.joined:
            text += (f"; the last {counted(data.joined, 'example')} of each epoch, fewer than the {data.min_batch} "
                     f"its micro-batches need, join the batch before (so that step differs with M and D)")
        return text

    def _plan(self) -> Plan:
        """The plan, made on rank 0 (which measures) and the same on every rank."""
        recipe, job = self.recipe, self.job
        decided: Plan | str | None = None
        self._costs: list[float] | None = None  # per-layer seconds the cut balanced (rank 0), when measured
        if self.layout.rank == 0:
            try:
                reused = saved_cut(job.resume, recipe, len(self.spec.layers)) if job.resume else None
                if reused is not None:
                    decided = make_plan(recipe, self.spec, available=job.available,
                                        chosen=(reused, "the checkpoint it resumes"))
                else:
                    measured, measured_by = self._measure()
                    self._costs = measured if measured_by and measured_by.startswith("measured time") else None
                    decided = make_plan(recipe, self.spec, measured, available=job.available,
                                        measured_by=measured_by)
            except UserError as exc:
                decided = str(exc)  # every rank stops with it, none waits for a plan that never comes
        decided = self.topo.share(decided)
        if isinstance(decided, str):
            raise UserError(decided)
        assert decided is not None
        return decided

    def _measure(self) -> tuple[list[float] | None, str | None]:
        """Per-layer costs for balance `auto`, `time` or `memory`, measured here, and what the plan calls them."""
        mode, device = self.recipe.pipeline.balance, self.topo.device
        if mode == "memory":
            sample, _ = self.spec.example_batch(microbatch_size(self.recipe), device)
            profile = profile_layers(self.spec.factories(), sample, self.recipe.seed, device)
            per_param = mm.bytes_per_parameter(optimizer_name(self.recipe))
            return [float(p.activation_bytes + p.params * per_param) for p in profile], None
        chunks = self.recipe.pipeline.partitions * self.recipe.pipeline.virtual_stages
        if mode not in ("auto", "time") or chunks in (1, len(self.spec.layers)):  # one cut only: nothing to time
            return None, None
        try:
            found = cost_cache.measured_costs(
                self.spec, self.recipe, microbatch_size(self.recipe), device,
                measuring=lambda note: self._note(f"timing each layer on {device.type} for the cut ({note})"))
        except Exception as exc:  # any failure to measure leaves the estimate, never stops the run
            why = (str(exc).strip().splitlines() or [""])[0][:200]
            return None, f"estimated FLOPs: measuring failed ({type(exc).__name__}{f': {why}' if why else ''})"
        return found.profile.balance_costs(self.recipe.pipeline.checkpoint), found.label

    def _resume(self) -> int:
        """Continue from the newest whole checkpoint at the --resume location; return its step."""
        assert self.job.resume is not None
        found = self.checkpoints.resume(self.job.resume)  # falls back past damaged checkpoints
        path, step = found.path, found.step
        # The launcher refused this already where train.steps alone decides; train.epochs needs the data.
        if step > self.total_steps:
            raise UserError(past_end(self.job.resume, path.name, step, *self._end()))
        if self.layout.rank == 0 and step < self.total_steps:
            # A checkpoint an earlier resume set aside continues its own course, which left this one at `fork`.
            fork = fork_of(path)
            fork = step if fork is None else fork
            aside = rewind(self.run_dir, fork, step, path.parent if fork != step else None,
                           time.strftime("%Y%m%d-%H%M%S"))
            print(f"[gpipe] resumed from {path_line(path)} (step {step})", file=sys.stderr, flush=True)
            if aside is not None:
                names = ", ".join(sorted(p.name for p in aside.iterdir() if p.is_dir()))
                print(f"[gpipe] moved the checkpoints after step {fork} ({names}) to {aside}, with their records: "
                      f"the run trains on from step {step}", file=sys.stderr, flush=True)
        changed = data_change(found.manifest.get("data"), self.checkpoints.data) if self.layout.rank == 0 else ""
        if changed:  # an evaluation alone (of a finished run) reads the data as it is now too
            print(f"[gpipe] the data changed since step {step} was saved: {changed}; the run goes on with the data "
                  "as it is now", file=sys.stderr, flush=True)
        elif self.layout.rank == 0 and split_rule_changed(found.manifest.get("data"), self.checkpoints.data):
            print(f"[gpipe] step {step} was saved by an earlier version of gpipe-cli, which held out other examples "
                  "than this version, which holds each line, row or image out by a hash of it: the examples trained on "
                  "from here, and their order, differ from that run's", file=sys.stderr, flush=True)
        if self.layout.rank == 0 and self.data is not None and eval_cut_changed(found.manifest.get("data")) \
                and self.data.earlier_eval_differs(self.recipe.eval.batches):
            print(f"[gpipe] step {step} was saved by an earlier version of gpipe-cli, which joined short held-out "
                  "batches up to M x D examples: the eval.batches scored from here hold other examples than that "
                  "run's evaluations", file=sys.stderr, flush=True)
        # train.max_skipped counts the skips in a row across a resume, as in a run never stopped.
        self.skipped_before = self.topo.share(skipped_until(self.run_dir, step) if self.layout.rank == 0 else None)
        return step

    def _missed_eval(self) -> bool:
        """Whether a stop cut short the evaluation of the step this resume starts from (every rank alike)."""
        step, every = self.start_step, self.recipe.eval.every
        due = bool(step and self.eval_steps and (step == self.total_steps or (every and step % every == 0)))
        if not due:  # the same on every rank: nothing to agree on
            return False
        return bool(self.topo.share(evaluation_missing(self.run_dir, step)[0] if self.layout.rank == 0 else None))

    def _evaluate_missed(self) -> bool:
        """Evaluate the step resumed from, as the stop that ended the last course kept it from; False: stopped again."""
        step = self.start_step
        self._message(f"evaluating step {step} first: the run's records hold no evaluation of it")
        self.stop.arm()  # a stop now ends the evaluation and the run: the step is saved already
        heartbeat.training_started()
        self.stop.when = (f"the evaluation of step {step}; step {step} is saved" if not self.complete
                          else "the final evaluation; training is done and saved")
        if self.view is not None:  # its eval line, or the final one's for the summary line below
            self.view.total = self.total_steps
        if not self.evaluate(step, final=self.complete):
            return False
        self.stop.when = AFTER_STEP
        if self.complete and self.summary.last_eval is not None:  # as the summary would give it
            self._message(f"final eval: step {step}: {eval_figures(self.summary.last_eval)}")
        return True

    def _end(self) -> tuple[str, str]:
        """The last step in the recipe's words, and the key that sets it."""
        train = self.recipe.train
        if train.epochs and (train.steps is None or train.epochs * self.steps_per_epoch < train.steps):
            return f"the {self.total_steps} steps of train.epochs {train.epochs}", "train.epochs"
        return f"train.steps {train.steps}", "train.steps"

    # ----------------------------------------------------------------- the loop

    def _read(self, batches: Iterator[Batch | None]) -> Iterator[Batch | None]:
        """`batches`; data unreadable past the first step is said with where the run stopped and how it goes on."""
        step = self.start_step
        try:
            for batch in batches:
                yield batch
                step += 1
        except DataError as exc:  # a damaged file the loader reached only now (an image folder is read lazily)
            if step == self.start_step:
                raise
            # Without a checkpoint nor a step recorded yet the run's directory goes as it ends: nothing to resume.
            then = way_on(self.run_dir) if candidates(self.run_dir) else "start the run again (it kept no checkpoint)"
            raise DataError(f"{exc}; the run stopped at step {step + 1}, whose batch holds it: replace or remove the "
                            f"file, then {then}") from None

    def batches(self, start_step: int) -> Iterator[Batch | None]:
        """This rank's shard of every training mini-batch from `start_step` on (None: no data here)."""
        if self.data is None:
            return itertools.repeat(None, self.total_steps - start_step)  # a list would hold 8 bytes a step
        first, index = divmod(start_step, self.steps_per_epoch)
        epochs = (self.data.train_batches(epoch=epoch, start=index if epoch == first else 0,
                                          shard=(self.layout.replica, self.layout.replicas),
                                          need_inputs=self.layout.is_first, need_targets=self.layout.is_last)
                  for epoch in itertools.count(first))
        return itertools.islice(itertools.chain.from_iterable(epochs), self.total_steps - start_step)

    def run(self) -> int:
        """Train for the recipe's steps or epochs, evaluating and checkpointing as asked and at the end; exit code."""
        recipe = self.recipe
        if self.complete and self.missed_eval:  # stopped in its final evaluation: that, and nothing else
            if not self._evaluate_missed():
                self.close()
                return 128 + self.stopped_by
            self._message(f"the run in {path_line(self.run_dir)} is complete at step {self.start_step}, its final "
                          "evaluation recorded")
            if self.metrics is not None:
                self.metrics.close()
            self.pipe.close()
            return 0
        if self.complete:
            self._message(complete_line(self.run_dir, self.start_step, *self._end(),
                                        earlier=earlier_checkpoint(str(self.job.resume))))
            self.pipe.close()
            return 0
        if self.view is not None:
            self.view.start(self.total_steps, self.start_step)
        if self.missed_eval and not self._evaluate_missed():
            self.close()
            return 128 + self.stopped_by
        heartbeat.training_started()
        # The host launches step t+1 before it reads step t's figures, so it never waits for the device
        # inside a step; anything that must see a finished step (a checkpoint, an evaluation, a stop) reads
        # the step in flight first.
        # A step's time runs from its launch to the next step's (or, at a boundary, to its own figures).
        pending: tuple[int, Batch | None, PendingStep, float] | None = None
        heartbeat.working_on(self.start_step + 1)
        for step, batch in enumerate(self._read(self.batches(self.start_step)), start=self.start_step):
            self.profiler.before(step + 1)
            started = time.perf_counter()
            # The loader leaves out what this rank's stage does not need (inputs, targets or both).
            launched = self.pipe.launch_step(
                batch.inputs if batch else None, batch.targets if batch else None,
                microbatches=recipe.pipeline.microbatches, step=step,
                example_offset=batch.offset if batch is not None else 0, max_grad_norm=recipe.train.grad_clip,
                optimizer=self.optimizer,
                # The first step of a start and every memory_every-th count every stored activation.
                measure_memory=step == self.start_step or (step + 1) % recipe.train.memory_every == 0)
            heartbeat.working_on(step + 2)  # the next to read and launch, but while a step's figures are read
            if self.scheduler is not None:
                self.scheduler.step()
            self.pipe.zero_grad()
            if pending is not None and self._finish(*pending, ended=started) == "stop":
                pending = None
                break
            pending = (step, batch, launched, started)
            trace = self.profiler.after(step + 1)
            if trace is not None:  # said after the traced steps' own lines: the last one's is read first
                decision, pending = self._finish(*pending), None
                self._profiled(trace)
                if decision == "stop":
                    break
            done = step + 1
            if step == self.start_step:
                self._going_on()
            self.stopped_by = self.stop.agreed(self.topo.transport.control, self.topo.distributed)
            saving = bool(self.stopped_by or (recipe.checkpoint.every and done % recipe.checkpoint.every == 0))
            evaluating = bool(recipe.eval.every and done % recipe.eval.every == 0 and done < self.total_steps)
            if pending is not None and (saving or evaluating or done == self.total_steps):
                decision, pending = self._finish(*pending), None
                if decision == "stop":
                    break
            if saving:
                self._save(done)
            if self.stopped_by:
                break
            if evaluating:
                self.stop.when = f"the evaluation at step {done}; step {done} is saved before the run stops"
                if not self.evaluate(done):  # a stop came during it: save and stop now
                    if self.checkpoints.last_saved != done:
                        self._save(done)
                    break
                self.stop.when = AFTER_STEP
        if pending is not None:
            self._finish(*pending)
        if not self.stopped_by and not self.diverged:
            if self.checkpoints.last_saved != self.total_steps:
                self._save(self.total_steps)
            if self.eval_steps:
                self.stop.when = "the final evaluation; training is done and saved"
                self._message(f"evaluating the trained model on {self.eval_steps} held-out "
                              f"batch{'es' if self.eval_steps > 1 else ''}")
                self.evaluate(self.total_steps, final=True)
            else:
                self._message("no final evaluation: the data holds nothing out "
                              + (f"({self.held_none})" if self.held_none else
                                 f"(data.eval_fraction {self.recipe.data.eval_fraction:g})"))
        self.close()
        code = NONFINITE_EXIT_CODE if self.diverged else 128 + self.stopped_by if self.stopped_by else 0
        self.stop.disarm(code)
        # A stop in the last moments, after every check: the work is done, but the launcher tearing the job down
        # would not read a rank that returns as if it had asked nothing.
        return code or (128 + self.stop.signum if self.stop.signum else 0)

    def _going_on(self) -> None:
        """The first step is in: a stop now saves a checkpoint, and a resume's recipe.yaml records its settings."""
        self.stop.arm()
        # Only now: a resume refused, or stopped before its first step, leaves the run's recipe as it was, and the
        # next resume and `gpipe report` read the settings its steps ran with. Once armed, a stop waits for this.
        if self.job.resume and self.layout.rank == 0:
            save_recipe(self.recipe, self.run_dir)

    def _finish(self, step: int, batch: Batch | None, launched: PendingStep, started: float,
                ended: float | None = None) -> str:
        """Read a launched step's figures (the step's one wait for the device), record them, and decide."""
        after = heartbeat.working_on(step + 1)
        result = launched.result()
        heartbeat.working_on(after)
        seconds = (ended if ended is not None else time.perf_counter()) - started
        heartbeat.step_done(seconds)
        # Every rank sees the same finiteness (the engine agrees on it), so all decide alike.
        decision = self.policy.decide(not result.skipped)
        if self.layout.rank == 0:
            assert batch is not None
            self._record_step(step, batch, result, seconds, decision)
        if decision == "stop":
            self.diverged = self.diverged or "non-finite values"
        return decision

    def _profiled(self, trace: Path | None) -> None:
        if trace is not None:
            first, last = self.profiler.traced
            self._message(f"profile: step{'s' if last > first else ''} {number_range(first, last)} traced in "
                              f"{trace.parent} (rank<N>.trace.json.gz for each rank; open in https://ui.perfetto.dev)")

    def _save(self, step: int) -> None:
        path = self.checkpoints.save(step, epoch=(step - 1) // self.steps_per_epoch + 1)
        self._message(f"checkpoint: {path_line(path)}")

    def _record_step(self, step: int, batch: Batch, result: Any, seconds: float, decision: str) -> None:
        stats = result.stats
        assert stats is not None and self.metrics is not None and self.view is not None
        stages = stats.of_replica(0)
        # The loop's wall time and the stages' own timelines, made to agree (see step_figures.py).
        figures = step_figures(stats, seconds)
        seconds = figures.seconds
        pipe = self.recipe.pipeline
        record: TrainRecord = {
            "kind": "train", "step": step + 1, "epoch": step // self.steps_per_epoch + 1, "loss": result.loss,
            "lr": optim.base_lr(self.recipe) * self.lr(step), "samples_per_s": batch.global_size / seconds,
            "step_time_s": seconds, "bubble": figures.bubble, "bubble_theory": stats.bubble_theory,
            "idle": figures.idle, "time_s": figures.parts, "rss_peak_bytes": [s.rss_peak for s in stages],
            "grad_norm": result.grad_norm, "microbatches": pipe.microbatches, "schedule": pipe.schedule,
            "data_parallel": pipe.data_parallel,
        }
        if all(s.activation_peak >= 0 for s in stages):  # a step that counted its stored activations
            record["activation_peak_bytes"] = [s.activation_peak for s in stages]
        if all(s.memory_peak >= 0 for s in stages):
            record["mem_peak_bytes"] = [s.memory_peak for s in stages]
        if any(s.cuda_peak for s in stages):
            record["cuda_peak_bytes"] = [s.cuda_peak for s in stages]
        if self.spec.task != "image":
            record["tokens_per_s"] = stats.units / seconds
        if self.model_flops is not None and self.peak is not None:
            flops = self.model_flops.of_step(batch.global_size, stats.units if self.spec.task != "image" else None)
            record.update(utilization_of(flops, seconds, self.peak.flops_per_s, self.layout.world_size))
        if result.skipped:
            record["skipped"] = True
        if result.loss_scale is not None:
            record["loss_scale"] = result.loss_scale
        if step == self.start_step:  # the first step of each start carries one-time costs (allocations, lazy set-up)
            record["warmup"] = True
        if step == self.start_step > 0:  # the first step after a resume warms up again, as the run's first did
            record["resumed"] = True
        if self.profiler.profiled(step + 1):  # its time holds the profiler's: the means leave it out
            record["profiled"] = True
        self.metrics.write(record)
        self.summary.add(record, batch.global_size, stats.units)
        self.view.show(record, self.recipe.train.log_every)
        output.check_readers()
        if decision == "ok":
            return
        what = nonfinite.what_went_wrong(result.loss, result.grad_norm, stats.nonfinite(), self.spec.layer_names)
        if decision == "skip":
            self.view.message(nonfinite.skipped_line(step + 1, self.total_steps, what, self.policy, result.loss_scale))
        else:
            saved = self.checkpoints.last_saved
            path = str(checkpoint.path_for(self.run_dir, saved)) if saved >= 0 else None
            self.diverged = nonfinite.stop_line(step + 1, what, self.policy, path, result.loss_scale)

    def _stop_agreed(self, final: bool) -> bool:
        """Whether any rank received a stop signal (every rank calls this alike); it cuts an evaluation short."""
        self.stopped_by = self.stop.agreed(self.topo.transport.control, self.topo.distributed, say=not final)
        return bool(self.stopped_by)

    def evaluate(self, step: int, final: bool = False) -> bool:
        """Loss and accuracy (and BLEU for translation) on the held-out split; False: a stop cut it short unrecorded."""
        with heartbeat.evaluating(step):  # a stall in it is said to be in the evaluation after step N
            layout = self.layout
            batches: Iterator[Batch | None] = iter([None] * self.eval_steps)
            if self.data is not None:
                batches = self.data.eval_batches(shard=(layout.replica, layout.replicas),
                                                 limit=self.recipe.eval.batches, need_inputs=layout.is_first,
                                                 need_targets=layout.is_last)
            metrics = evaluation.metrics_for(self.spec)
            loss = units = 0.0
            sums = dict.fromkeys(metrics, 0.0)
            for batch in batches:
                if self._stop_agreed(final):
                    return False
                result = self.pipe.evaluate(batch.inputs if batch is not None and layout.is_first else None,
                                            batch.targets if batch is not None and layout.is_last else None,
                                            microbatches=self.recipe.pipeline.microbatches, metrics=metrics)
                heartbeat.evaluated()  # progress: with one stage, no transfer says so
                loss += result.loss * result.units if result.units else 0.0
                units += result.units
                for key in sums:
                    sums[key] += result.metrics[key]
            baselines = self.data.eval_baselines(self.recipe.eval.batches) if self.data is not None else None
            record: EvalRecord = {"kind": "eval", "step": step, "loss": loss / units if units else float("nan"),
                                  **evaluation.summarise(sums, units, baselines)}
            if self.spec.task == "translation" and isinstance(self.recipe.model, TransformerModel):
                score = evaluation.bleu(self.pipe, self.topo, self.data, self.eval_steps,
                                        self.recipe.pipeline.microbatches, self.recipe.model.max_len,
                                        stopped=lambda: self._stop_agreed(final))
                if self.stopped_by:
                    return False
                if score is not None:
                    record["bleu"] = score
            if layout.rank == 0:
                assert self.metrics is not None and self.view is not None
                self.metrics.write(record)
                self.summary.add(record, 0, None)
                self.view.show(record)
            # Every rank leaves together: rank 0's scoring and writing would count as the next step's wait on the
            # stages that started it first (0.26 s of the quick start's step 101, which computes 0.16 s).
            self.topo.share(None)
            return True

    def close(self) -> None:
        """Finish the run: stop the view, close files and channels."""
        if self.view is not None:
            self.view.stop()
            saved = self.checkpoints.last_saved
            ended = ""
            if self.stopped_by:
                cause = self.stop.cause(self.stopped_by)
                ended = f"stopped as {cause}" if self.stop.orphaned else f"stopped by {cause}"
                # Without a recipe the resume trains with the run's own recipe.yaml: this command continues
                # the run exactly as it was started, whatever recipe and --set started it.
                line = f"{ended} after step {saved}; continue with {continue_command(self.run_dir)}"
                if saved == self.total_steps:  # in the final evaluation: a resume would have nothing to do
                    line = f"{ended} in the final evaluation; training is done and step {saved} saved"
                self.view.message(line)
                if self.stopped_by == signal.SIGPIPE:  # the output is gone: the way on goes where errors go
                    print(f"[gpipe] {line}", file=sys.stderr, flush=True)
            elif self.diverged:
                ended = "stopped on non-finite values"
            for line in self.summary.lines(time.time(), str(checkpoint.path_for(self.run_dir, saved))
                                           if saved >= 0 else None, str(self.run_dir), self.spec.task != "image",
                                           ended):
                self.view.message(line)
            if self.diverged:  # the one line that says why, last and on stderr like every error
                print(f"[gpipe] {self.diverged}", file=sys.stderr, flush=True)
        self._profiled(self.profiler.close())  # a run that stopped inside the profiled steps
        if self.metrics is not None:
            self._log_model()
            self.metrics.close()
        self.pipe.close()

    def _log_model(self) -> None:
        """With `metrics.wandb.artifact`, export the final checkpoint's model into the run and log it (rank 0)."""
        wandb = self.recipe.metrics.wandb
        sinks = self.metrics.sinks if self.metrics is not None else None
        if wandb is None or not wandb.artifact or sinks is None or not sinks.takes_models():
            return
        if self.checkpoints.last_saved < 0:
            self._message("metrics.wandb.artifact: no checkpoint was written, so there is no model to log")
            return
        try:
            path = export_model(str(self.run_dir))
        except UserError as err:
            self._message(f"metrics.wandb.artifact: could not export the model ({err})")
            return
        self._message(f"exported {path} for metrics.wandb.artifact")
        sinks.log_model(path)

    def _message(self, text: str) -> None:
        """A line on the launching terminal (rank 0)."""
        if self.view is not None:
            self.view.message(text)
