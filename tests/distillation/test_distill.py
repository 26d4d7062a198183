"""`llmq distill` on tiny models: the loss falls, the student reloads in transformers with the
perplexity the loop measured, zeros stay zero, a resumed run (after Ctrl-C or SIGKILL) equals an
uninterrupted one, two gloo processes follow one process's loss, and bad input is refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import llmq
from llmq.cli.main import app
from tests.conftest import assert_bad_input

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
# Short windows and few of them: the mechanics, not the accuracy (that is benchmarks/).
FAST = {"seq_len": 64, "batch_size": 2, "grad_accum": 2, "eval_windows": 2, "eval_seq_len": 64,
        "evaluate": False, "reference": False}  # fmt: skip
FAST_CLI = ["--seq-len", "64", "--batch-size", "2", "--grad-accum", "2", "--eval-windows", "2",
            "--no-evaluate", "--no-reference"]  # fmt: skip


def weights(folder: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def heldout_kl(teacher: Path, student: Path) -> float:
    """KL(teacher || student) per token on held-out news windows, computed with transformers."""
    from llmq.calib.data import evaluation_windows
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.distillation.loss import kl_divergence

    ids = evaluation_windows(load_tokenizer(teacher), "news", seq_len=64, max_windows=4).input_ids
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(m)(ids).logits for m in (teacher, student)]
    return kl_divergence(logits[1], logits[0]).item()


@pytest.mark.slow
def test_distillation_moves_the_student_to_the_teacher_and_writes_what_transformers_loads(
    tmp_path: Path, teacher: Path, student: Path
) -> None:
    out = tmp_path / "out"
    result = llmq.distill(teacher, student, out, max_steps=16, lr=3e-4, eval_every=8, **FAST)
    assert result.steps == 16 and result.tokens == 16 * 4 * 64
    assert [e["step"] for e in result.evaluations] == [0, 8, 16]
    assert heldout_kl(teacher, out) < 0.8 * heldout_kl(teacher, student)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.intermediate_size == 256
    before, after = weights(student), weights(out)
    assert before.keys() == after.keys()
    assert all(after[n].dtype == before[n].dtype for n in before)
    assert not torch.equal(before["model.layers.0.mlp.down_proj.weight"], after["model.layers.0.mlp.down_proj.weight"])  # fmt: skip
    # The loop's held-out perplexity of the student it kept is what `llmq eval` measures on it.
    kept = next(e for e in result.evaluations if e["step"] == result.kept_step)
    measured = llmq.evaluate(out, seq_len=64, max_windows=2, use_cache=False)
    assert measured.model.perplexity == pytest.approx(kept["perplexity"], rel=1e-4)
    record = json.loads((out / "llmq.json").read_text())["distillation"]
    assert record["config"]["loss"] == "forward-kl" and record["steps"] == 16
    assert not list(tmp_path.glob(".*partial*"))  # published whole, nothing left behind


@pytest.mark.parametrize("sparsity", [0.5, 0.05])
def test_pruned_weights_stay_exactly_zero(tmp_path: Path, teacher: Path, sparsity: float) -> None:
    """Zeros stay zero: at 50% by the tensors alone, at 5% (below MASKED_MIN_ZEROS) because the
    student's llmq.json records llmq's pruning."""
    sparse = tmp_path / "sparse"
    llmq.prune(teacher, sparse, method="magnitude", sparsity=sparsity, skip_layer_check=True,
               reference=False)  # fmt: skip
    out = tmp_path / "out"
    result = llmq.distill(teacher, sparse, out, max_steps=3, lr=1e-2, keep="last", **FAST)
    assert result.masked_linears == 2 * 7  # every decoder linear of both layers
    before, after = weights(sparse), weights(out)
    for name, weight in before.items():
        if name.endswith("proj.weight"):
            assert torch.equal(after[name] == 0, weight == 0), name
            assert not torch.equal(after[name], weight), name  # the rest did train


def test_a_light_pruning_without_llmqs_record_is_trained_as_dense(tmp_path: Path, teacher: Path) -> None:  # fmt: skip
    """5% zeros from another tool (no llmq.json) are below MASKED_MIN_ZEROS: no masks."""
    sparse = tmp_path / "sparse"
    llmq.prune(teacher, sparse, method="magnitude", sparsity=0.05, skip_layer_check=True,
               reference=False)  # fmt: skip
    (sparse / "llmq.json").unlink()
    result = llmq.distill(teacher, sparse, tmp_path / "out", max_steps=1, keep="last", **FAST)
    assert result.masked_linears == 0


class InterruptAfter:
    """A progress sink that raises KeyboardInterrupt (as Ctrl-C would) after N steps."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    @contextmanager
    def stage(self, description: str, total: int | None = None, *, transient: bool = False):
        def advance(steps: int = 1, status: str | None = None) -> None:
            if description == "distilling" and status is not None:
                self.steps -= steps
                if self.steps <= 0:
                    raise KeyboardInterrupt

        yield advance


@pytest.mark.slow
def test_resume_after_an_interruption_equals_an_uninterrupted_run(
    tmp_path: Path, teacher: Path, student: Path
) -> None:
    options = {**FAST, "max_steps": 6, "lr": 1e-3, "eval_every": 2, "checkpoint_every": 2}
    whole = llmq.distill(teacher, student, tmp_path / "whole", **options)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        llmq.distill(teacher, student, out, progress=InterruptAfter(3), **options)
    assert not out.exists()
    assert (tmp_path / ".resumed.llmq-partial" / ".distill" / "latest").read_text() == "step-0000002"  # fmt: skip
    resumed = llmq.distill(teacher, student, out, resume=True, **options)
    assert resumed.losses == whole.losses and resumed.evaluations == whole.evaluations
    assert_same_weights(tmp_path / "whole", out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmq", "distill", *args]


@pytest.mark.process
def test_resume_after_sigkill_equals_an_uninterrupted_run(
    tmp_path: Path, teacher: Path, student: Path
) -> None:
    args = ["--teacher", str(teacher), "--student", str(student), *FAST_CLI, "--max-steps", "10",
            "--checkpoint-every", "3", "--lr", "1e-3"]  # fmt: skip
    out = tmp_path / "killed"
    pointer = tmp_path / ".killed.llmq-partial" / ".distill" / "latest"
    proc = subprocess.Popen(cli(*args, "--out", str(out)), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 120
    while not pointer.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode() if proc.stderr else ""
    assert not out.exists()
    done = subprocess.run(cli(*args, "--out", str(out), "--resume", "--json"), cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    whole = subprocess.run(cli(*args, "--out", str(tmp_path / "whole"), "--json"), cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert json.loads(done.stdout)["losses"] == json.loads(whole.stdout)["losses"]
    assert_same_weights(tmp_path / "whole", out)


def torchrun(processes: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
            "--master-port", str(free_port()), "-m", "llmq", "distill"]  # fmt: skip


GLOO_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
@pytest.mark.process
def test_two_gloo_processes_follow_one_process_with_the_same_global_batch(
    tmp_path: Path, teacher: Path, student: Path, sharding: str
) -> None:
    common = ["--teacher", str(teacher), "--student", str(student), "--seq-len", "64",
              "--eval-windows", "2", "--no-evaluate", "--no-reference", "--max-steps", "4",
              "--lr", "1e-3", "--batch-size", "1", "--json"]  # fmt: skip
    one = subprocess.run(cli(*common, "--grad-accum", "2", "--out", str(tmp_path / "one")), cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert one.returncode == 0, one.stderr
    two = subprocess.run([*torchrun(), *common, "--grad-accum", "1", "--sharding", sharding, "--out", str(tmp_path / "two")], cwd=REPO, capture_output=True, text=True, env=GLOO_ENV)  # fmt: skip
    assert two.returncode == 0, two.stderr
    single, parallel = json.loads(one.stdout), json.loads(two.stdout)
    assert parallel["processes"] == 2 and parallel["tokens"] == single["tokens"]
    assert parallel["losses"] == pytest.approx(single["losses"], rel=1e-4)
    for a, b in zip(parallel["evaluations"], single["evaluations"], strict=True):
        assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-4)
    # written whole (under fsdp gathered from the shards): the files score what training measured
    final = next(e["perplexity"] for e in parallel["evaluations"] if e["step"] == parallel["kept_step"])  # fmt: skip
    written = llmq.evaluate(tmp_path / "two", max_windows=2, use_cache=False)
    assert written.model.perplexity == pytest.approx(final, rel=1e-4)


def other_vocabulary(tmp_path: Path, student: Path) -> Path:
    """The student with the ids of two of its tokens swapped (still a valid tokenizer)."""
    folder = tmp_path / "other-vocab"
    shutil.copytree(student, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, Any] = tokenizer["model"]["vocab"]
    first, second = [t for t in vocab if t.isalpha() and len(t) > 3][:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def test_bad_input_is_refused_in_one_line_before_any_work(
    tmp_path: Path, teacher: Path, student: Path
) -> None:
    base = ["distill", "--teacher", str(teacher), "--out", str(tmp_path / "out")]
    other = str(other_vocabulary(tmp_path, student))
    text_file = str(teacher / "config.json")
    steps = ["--student", str(student), "--max-steps", "2"]
    cases = [
        (["--student", str(student), "--max-steps", "0"], "max_steps"),
        (["--student", str(student)], "--max-steps or --max-tokens"),
        (["--student", str(tmp_path)], str(tmp_path)),
        (["--student", other, "--max-steps", "2"], "other tokens"),
        ([*steps, "--loss", "mse"], "loss"),
        ([*steps, "--train-text", text_file, "--eval-text", text_file], "also the training data"),
        ([*steps, "--warmup-steps", "2"], "warmup_steps"),
        ([*steps, "--checkpoint-every", "0"], "--checkpoint-every"),
    ]
    for args, fragment in cases:
        assert_bad_input(runner.invoke(app, [*base, *args]), fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_each_loss_is_what_it_says_on_the_first_batch(
    tmp_path: Path, teacher: Path, student: Path
) -> None:
    """One step each from the same student and batch: plain cross-entropy equals transformers'
    own language-model loss, and the CE and hidden-state terms add to the KL."""
    from llmq.calib.data import training_windows
    from llmq.calib.tokenizer import load_tokenizer
    from llmq.distillation.data import BatchOrder

    def first_loss(name: str, **options: Any) -> float:
        result = llmq.distill(teacher, student, tmp_path / name, max_steps=1, keep="last", **{**FAST, **options})  # fmt: skip
        return result.losses[0]

    windows = training_windows(load_tokenizer(student), "shakespeare+pydoc", seq_len=64)
    ids = BatchOrder(windows.input_ids, global_batch=4, seed=0).batch(0)
    with torch.no_grad():
        expected_ce = AutoModelForCausalLM.from_pretrained(student)(ids, labels=ids).loss.item()
    assert first_loss("ce", loss="ce") == pytest.approx(expected_ce, rel=1e-5)
    forward = first_loss("kl")
    assert first_loss("kl-ce", ce_weight=1.0) == pytest.approx(forward + expected_ce, rel=1e-5)
    assert first_loss("kl-hidden", hidden_weight=1.0) > forward
    assert first_loss("reverse", loss="reverse-kl") != pytest.approx(forward, rel=1e-3)


def test_max_grad_norm_0_turns_clipping_off(tmp_path: Path, teacher: Path, student: Path) -> None:
    args = ["distill", "--teacher", str(teacher), "--student", str(student), "--out", str(tmp_path / "o"),
            *FAST_CLI, "--max-steps", "1", "--max-grad-norm", "0", "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["max_grad_norm"] is None
