"""Writing a distillation's result: the trained student under the source checkpoint's names
and dtypes, or with QAT the scheme's compressed-tensors checkpoint; published whole."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from llmq.config import DistillConfig
from llmq.distillation.models import write_student
from llmq.distillation.state import remove_state
from llmq.io.atomic import add_to_record, publish
from llmq.io.record import OutputRecord
from llmq.progress import Progress


def write_result(
    run: Any,
    state: dict[str, Any],
    student: Any,
    staging: Path,
    out: Path,
    result: dict[str, Any],
    device: Any,
    reference: bool,
    progress: Progress,
) -> None:
    """Write the student (`state`: the state dict to write; `result`: the run's summary, kept
    in llmq.json) into `staging` and publish it at `out`; with QAT, quantize it first
    (export_qat)."""
    summary = {k: v for k, v in result.items() if k not in ("out_dir", "perplexity")}
    record = OutputRecord(source_model=str(student.path), distillation=summary)
    staging.mkdir(parents=True, exist_ok=True)  # kept no best student nor resume point yet
    with progress.stage("writing the student"):
        write_student(state, student, staging, record, str(device), reference=reference)
    remove_state(staging)
    if run.config.qat is not None:  # the float student becomes the quantized checkpoint
        from llmq.distillation.qat import start_folder

        shutil.rmtree(start_folder(staging), ignore_errors=True)
        staging = export_qat(run.config, staging, summary, progress)
    publish(staging, out)


def export_qat(config: DistillConfig, float_student: Path, summary: dict[str, Any], progress: Progress) -> Path:  # fmt: skip
    """The trained student quantized by RTN into a staging folder of its own (the codes the
    fake-quantized forward used), with the distillation's record; the float one removed."""
    from llmq.distillation.qat import export

    quantized = float_student.with_name(float_student.name + "-qat")
    assert config.qat is not None
    export(float_student, quantized, config.qat.scheme, config.qat.group_size, progress)
    add_to_record(quantized, distillation=summary)
    shutil.rmtree(float_student)
    return quantized
