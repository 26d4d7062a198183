"""`run`: a recipe's stages in order, each into its own folder under OUT, resumable.

OUT/llmq-run.json records the effective recipe, the model and each finished stage's summary,
rewritten atomically after every stage. `resume=True` checks that the recipe and the model are
the same, skips the finished stages and continues the first unfinished one from its own
resume point where it has one (quantize, prune, distill). A failed gate ends the run there.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmq.api.common import _open
from llmq.errors import InputError
from llmq.io.checkpoint import RUN_RECORD_FILE as RUN_FILE
from llmq.progress import NO_PROGRESS, Progress
from llmq.recipes.load import RecipeSource, effective, load_recipe
from llmq.recipes.schema import SOURCE, ChainRecipe, StageEntry

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StageResult:
    name: str
    kind: str
    output: str  # the stage's folder (or report file) under OUT
    seconds: float
    summary: dict[str, Any]  # the stage's result (its `--json`)
    passed: bool | None = None  # eval stages: the gate's verdict
    resumed: bool = False  # finished by an earlier run


@dataclass(slots=True)
class RunResult:
    model: str
    out_dir: Path
    recipe: dict[str, Any]  # the effective recipe, defaults filled in
    stages: list[StageResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(stage.passed is not False for stage in self.stages)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["out_dir"] = str(self.out_dir)
        data["passed"] = self.passed
        return data


def run(
    recipe: ChainRecipe | RecipeSource | str | Path,
    model: str | Path,
    out: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    keep_stages: bool = True,
    progress: Progress = NO_PROGRESS,
    device: str | None = None,
) -> RunResult:
    """Run RECIPE's stages on MODEL into OUT (a folder per stage). Everything is validated
    before the first stage starts: the recipe, every stage's options, the model.
    `keep_stages` False removes a stage's model folder once the next model is written (for
    recipes whose stages compare only with the source or outside folders)."""
    from llmq.io.atomic import claim_output, write_json

    chain = check_recipe(recipe).recipe
    source = _open(model, progress).path
    out = Path(out)
    record = {"model": str(source), "recipe": effective(chain)}
    result = RunResult(model=str(source), out_dir=out, recipe=record["recipe"])
    recipe_file = Path(recipe) if isinstance(recipe, str | Path) else None
    inputs = [("model", source), ("recipe", recipe_file), *chain.inputs()]
    with claim_output(out, inputs=inputs):
        finished = _start(out, record, resume=resume, overwrite=overwrite)
        names = chain.stage_names()
        current = source
        for index, (name, entry) in enumerate(zip(names, chain.stages, strict=True)):
            target = out / (f"{index + 1}-{name}" + (".json" if entry.kind == "eval" else ""))
            if name in finished:
                stage = StageResult(**finished[name])
                stage.resumed = True
            else:
                stage = _run_stage(entry, name, current, target, source, out, names, resume, progress, device)  # fmt: skip
                finished[name] = asdict(stage)
                write_json(out / RUN_FILE, {**record, "finished": finished})
            result.stages.append(stage)
            if stage.passed is False:
                break
            if entry.kind != "eval":
                if not keep_stages and current != source:
                    shutil.rmtree(current, ignore_errors=True)
                current = target
    return result


def check_recipe(recipe: ChainRecipe | RecipeSource | str | Path) -> RecipeSource:
    """The recipe, loaded if it is a file, with every stage's options checked as its command
    checks them (InputError naming the file, line and stage otherwise)."""
    if isinstance(recipe, ChainRecipe):
        source = RecipeSource(recipe)
    elif isinstance(recipe, RecipeSource):
        source = recipe
    else:
        source = load_recipe(Path(recipe))
    for index, entry in enumerate(source.recipe.stages):
        if entry.kind == "quantize" or (entry.kind == "prune" and not entry.stage.structured):
            try:
                pipeline_recipe(entry)
            except InputError as exc:
                where = source.where(("stages", index, entry.kind))
                raise InputError(f"{where}: {exc.message}", hint=exc.hint) from None
    return source


def pipeline_recipe(entry: StageEntry) -> Any:
    """The Recipe a quantize or one-shot prune stage runs: its options' (llmq.config.options),
    as its command builds it."""
    return entry.stage.options().recipe()


def _start(out: Path, record: dict[str, Any], *, resume: bool, overwrite: bool) -> dict[str, Any]:
    """The stages an earlier run into OUT finished (resume), or none with OUT made empty. OUT
    is replaced only when llmq wrote it (`check_output_dir`); --resume never writes into a
    folder that holds no run."""
    from llmq.io.atomic import check_output_dir, remove_partial_leftovers, write_json

    path = out / RUN_FILE
    if resume and path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise InputError(f"{path}: damaged (not JSON)", hint="start over without --resume (and with --overwrite)") from None  # fmt: skip
        if not isinstance(saved, dict) or {k: saved.get(k) for k in record} != record:
            raise InputError(
                f"{out}: the interrupted run had another recipe or model",
                hint="rerun it with the same recipe and model, or without --resume to start over",
            )
        return dict(saved.get("finished", {}))
    if resume:
        remove_partial_leftovers(out)  # a kill while RUN_FILE was first written leaves its partial
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise InputError(f"{out}: holds no interrupted `llmq run` (no {RUN_FILE}) to resume", hint="choose another --out, or drop --resume")  # fmt: skip
        log.warning("%s: nothing to resume; starting from the first stage", out)
    else:
        check_output_dir(out, overwrite=overwrite)
        if out.exists():
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, {**record, "finished": {}})  # marks OUT as llmq's from the start
    return {}


def _reference(name: str, source: Path, out: Path, names: list[str]) -> Path:
    """A `teacher` / `baseline`: the source, an earlier stage's output, or a folder."""
    if name == SOURCE:
        return source
    if name in names:
        return out / f"{names.index(name) + 1}-{name}"
    return Path(name)


def _run_stage(
    entry: StageEntry,
    name: str,
    current: Path,
    target: Path,
    source: Path,
    out: Path,
    names: list[str],
    resume: bool,
    progress: Progress,
    device: str | None,
) -> StageResult:
    from llmq.io.atomic import staging_path

    started = time.perf_counter()
    stage = entry.stage
    partial = resume and staging_path(target).exists()  # continue the stage where it stopped
    passed = None
    with progress.stage(f"stage {name}"):
        if entry.kind == "eval":
            summary, passed = _evaluate(stage, current, _reference(stage.baseline, source, out, names), target, progress, device)  # fmt: skip
        elif entry.kind == "distill":
            summary = _distill(stage, current, _reference(stage.teacher, source, out, names), target, partial, progress, device)  # fmt: skip
        elif entry.kind == "prune" and stage.structured:
            summary = _structured(stage, current, target, progress, device)
        else:
            summary = _pipeline(entry.kind, stage, current, target, partial, progress, device)
    seconds = round(time.perf_counter() - started, 3)
    return StageResult(name, entry.kind, str(target), seconds, summary, passed)


def _pipeline(kind: str, stage: Any, model: Path, out: Path, resume: bool, progress: Progress, device: str | None) -> dict[str, Any]:  # fmt: skip
    """quantize, or one-shot prune: the layer pipeline."""
    from llmq.api.quantize import prune, quantize

    verb = quantize if kind == "quantize" else prune
    return verb(
        model, out, stage.options(), resume=resume, overwrite=True, progress=progress,
        device=device,
    ).to_dict()  # fmt: skip


def _structured(stage: Any, model: Path, out: Path, progress: Progress, device: str | None) -> dict[str, Any]:  # fmt: skip
    from llmq.api.structured import prune_structured

    return prune_structured(
        model, out, stage.options(), overwrite=True, progress=progress, device=device
    ).to_dict()


def _distill(stage: Any, student: Path, teacher: Path, out: Path, resume: bool, progress: Progress, device: str | None) -> dict[str, Any]:  # fmt: skip
    from llmq.api.train import train

    options = stage.options()
    if stage.max_tokens is not None:
        options.pop("max_steps")
    return train(
        teacher, student, out, max_tokens=stage.max_tokens, checkpoint_every=stage.checkpoint_every,
        resume=resume, overwrite=True, progress=progress, device=device, **options,
    ).to_dict()  # fmt: skip


def _evaluate(stage: Any, model: Path, baseline: Path, report: Path, progress: Progress, device: str | None) -> tuple[dict[str, Any], bool | None]:  # fmt: skip
    from llmq.io.atomic import write_json

    if stage.tasks is not None:
        from llmq.api.tasks import evaluate_tasks

        result = evaluate_tasks(
            [model], stage.tasks, baseline=baseline, task_dir=stage.task_dir, limit=stage.limit,
            num_fewshot=stage.num_fewshot, max_drop=stage.max_drop,
            min_recovery=stage.min_recovery, confidence=stage.confidence,
            batch_size=stage.batch_size, progress=progress, device=device,
        )[0]  # fmt: skip
    else:
        from llmq.api.evaluate import evaluate

        result = evaluate(
            model, baseline=baseline, text=stage.eval_text, seq_len=stage.seq_len,
            max_windows=stage.eval_windows, max_ppl_increase=stage.max_ppl_increase,
            progress=progress, device=device,
        )  # fmt: skip
    summary = result.to_dict()
    write_json(report, summary)
    return summary, result.passed
