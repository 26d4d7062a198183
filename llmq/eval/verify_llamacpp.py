"""llama.cpp as a `llmq verify` loader of GGUF files: does llama.cpp compute the model the file's
tensors define, with the tokens the checkpoint's tokenizer gives?

llama.cpp exports no logits through a stable interface, but `llama-perplexity
--kl-divergence-base FILE` saves every scored position's log-probabilities: a header ("_logits_",
context, vocabulary, chunk count), the tokens it read, then per chunk the positions after its first
half, each as two float32s (scale, lowest log-probability) and a uint16 code per token (log-prob =
lowest + scale x code; logits more than 16 below the largest are stored at the lowest). That file is
read here; llmq's evaluator computes the same chunks (their first token replaced by BOS, as
llama-perplexity does) from the file's tensors, and the two are compared on the evaluator's top
tokens. llama.cpp rounds each matrix product's input to 8 bits per block for quantized weights
(Q8_K / Q8_0 dot products) and to float16 for float16 weights, so it is held to a bound on the
mean |Δ log-prob| (`LLAMA_CPP_TOLERANCE`), not to the float32 loaders' bound on the largest. Its tokens are compared first: the
text llama.cpp tokenized from the file's vocabulary must give the checkpoint tokenizer's ids.

The binaries are found in `$LLMQ_LLAMA_CPP` (a folder) or on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmq.calib.tokenizer import load_tokenizer
from llmq.errors import InputError
from llmq.eval.logits import (  # fmt: skip
    PromptReference,
    Reference,
    distance_on_top,
    evaluator_log_probs,
    top_tokens,
)
from llmq.eval.verify import Comparison, WrongTokens
from llmq.io.checkpoint import Checkpoint

LLAMA_CPP_ENV = "LLMQ_LLAMA_CPP"
PERPLEXITY = "llama-perplexity"
CONTEXT = 64  # tokens per chunk; llama-perplexity scores the second half of each
CHUNKS = 2
# Mean |Δ log-prob| on the reference's top tokens still counted as the same model in llama.cpp.
# Measured on the default model (SmolLM2, TEXT, 2 x 64 tokens): 0.0024 with every tensor F32 (max
# 0.019: the mapping, names and tokenizer are right), 0.16 for Q8_0 and 0.28 for Q4_K_M (max 1.2
# and 2.1: its 8-bit rounding of matrix inputs, which SmolLM2's outlier channels feel), 2.5 for a
# Q4_K_M file whose rotary base is written 100x too small.
LLAMA_CPP_TOLERANCE = 0.5
# A public-domain passage (Hamlet, III.1): long enough for CHUNKS x CONTEXT tokens in any
# tokenizer llmq writes.
TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die - to sleep,
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to: 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep, perchance to dream - ay, there's the rub:
For in that sleep of death what dreams may come,
When we have shuffled off this mortal coil,
Must give us pause - there's the respect
That makes calamity of so long life.
For who would bear the whips and scorns of time,
Th'oppressor's wrong, the proud man's contumely,
The pangs of dispriz'd love, the law's delay,
The insolence of office, and the spurns
That patient merit of th'unworthy takes,
When he himself might his quietus make
With a bare bodkin? Who would fardels bear,
To grunt and sweat under a weary life,
But that the dread of something after death,
The undiscovere'd country, from whose bourn
No traveller returns, puzzles the will,
And makes us rather bear those ills we have
Than fly to others that we know not of?
Thus conscience does make cowards of us all,
And thus the native hue of resolution
Is sicklied o'er with the pale cast of thought,
And enterprises of great pith and moment
With this regard their currents turn awry
And lose the name of action.
"""


def find_llama_perplexity() -> Path | None:
    """llama.cpp's llama-perplexity: in $LLMQ_LLAMA_CPP when it is set, else on PATH."""
    folder = os.environ.get(LLAMA_CPP_ENV)
    if folder:
        binary = Path(folder) / PERPLEXITY
        return binary if binary.is_file() and os.access(binary, os.X_OK) else None
    found = shutil.which(PERPLEXITY)
    return None if found is None else Path(found)


def require_llama_perplexity() -> Path:
    binary = find_llama_perplexity()
    if binary is None:
        where = os.environ.get(LLAMA_CPP_ENV)
        raise InputError(
            f"--loader llama.cpp: no {PERPLEXITY} " + (f"in {where}" if where else "on PATH"),
            hint=f"build llama.cpp (benchmarks/peers/setup_llamacpp.sh) and set {LLAMA_CPP_ENV} to its bin folder",
        )
    return binary


def llama_cpp_loader(path: Path, ckpt: Checkpoint, reference: Reference, device: str | None) -> Comparison:  # fmt: skip
    """llama.cpp's log-probabilities of the file on TEXT against llmq's evaluator on the same
    chunks. `reference` (the verify prompts) is not used: llama-perplexity reads text, not ids."""
    del reference
    saved = run_llama_perplexity(require_llama_perplexity(), path)
    tokenizer = load_tokenizer(ckpt.path)
    bos = [int(tokenizer.bos_token_id)] if tokenizer.add_bos else []
    expected = (bos + tokenizer.encode(TEXT))[: saved.tokens.size]
    if saved.tokens.ravel().tolist() != expected:
        position = next(i for i, (a, b) in enumerate(zip(saved.tokens.ravel().tolist(), expected, strict=False)) if a != b)  # fmt: skip
        raise WrongTokens(
            f"llama.cpp tokenizes the text differently from the checkpoint's tokenizer: token "
            f"{position} is {saved.tokens.ravel()[position]}, the tokenizer's is {expected[position]}"
        )
    # each chunk's first token replaced by BOS, as llama-perplexity runs it
    chunks = [bos + row.tolist()[len(bos) :] for row in saved.tokens]
    first = CONTEXT // 2
    ours = [values[first : CONTEXT - 1] for values in evaluator_log_probs(ckpt, chunks, device=device)]  # fmt: skip
    prompts = top_tokens(ours, chunks)
    floors = [torch.from_numpy(floor) for floor in saved.floors]
    # llama.cpp stores log-probs more than 16 below the largest at its floor: so is the reference
    clipped = [
        PromptReference(
            p.input_ids, p.top_ids, torch.tensor(p.top_logprobs).maximum(floor[:, None]).tolist()
        )
        for p, floor in zip(prompts, floors, strict=True)
    ]
    got = [
        torch.from_numpy(values).gather(-1, torch.tensor(p.top_ids))
        for values, p in zip(saved.log_probs, prompts, strict=True)
    ]
    return Comparison(distance_on_top(clipped, got), LLAMA_CPP_TOLERANCE, "weights alone, llama.cpp's arithmetic", "mean")  # fmt: skip


@dataclass(frozen=True, slots=True)
class SavedLogProbs:
    """What llama-perplexity --kl-divergence-base wrote: tokens [chunks, CONTEXT] as read, and
    per chunk the log-probabilities [positions, vocab] and floor [positions] of its scored half."""

    tokens: np.ndarray
    log_probs: list[np.ndarray]
    floors: list[np.ndarray]


def run_llama_perplexity(binary: Path, model: Path) -> SavedLogProbs:
    with tempfile.TemporaryDirectory(prefix="llmq-llama-cpp-") as folder:
        text, saved = Path(folder) / "text.txt", Path(folder) / "logits.bin"
        text.write_text(TEXT, encoding="utf-8")
        command = [
            str(binary), "-m", str(model), "-f", str(text), "-c", str(CONTEXT), "-b", str(CONTEXT),
            "--chunks", str(CHUNKS), "-t", str(os.cpu_count() or 1), "--kl-divergence-base", str(saved),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not saved.is_file():
            errors = [line for line in done.stderr.splitlines() if " E " in line or "error" in line]
            raise RuntimeError(f"{PERPLEXITY} failed: {(errors or [done.stderr.strip()[-200:]])[0].strip()}")  # fmt: skip
        return read_saved_log_probs(saved.read_bytes())


def read_saved_log_probs(raw: bytes) -> SavedLogProbs:
    """Parse llama-perplexity's --kl-divergence-base file (layout in the module docstring)."""
    if raw[:8] != b"_logits_":
        raise RuntimeError("not a llama-perplexity logits file")
    context, vocab, chunks = np.frombuffer(raw, dtype=np.int32, count=3, offset=8).tolist()
    offset = 20
    tokens = np.frombuffer(raw, dtype=np.int32, count=chunks * context, offset=offset)
    offset += tokens.nbytes
    row = 2 * ((vocab + 1) // 2) + 4  # uint16s per position: 2 float32s, then the codes
    positions = context - 1 - context // 2
    log_probs, floors = [], []
    for _ in range(chunks):
        block = np.frombuffer(raw, dtype=np.uint16, count=positions * row, offset=offset)
        offset += block.nbytes
        block = block.reshape(positions, row)
        header = np.ascontiguousarray(block[:, :4]).view(np.float32)  # [positions, 2]
        scale, floor = header[:, 0:1], header[:, 1]
        log_probs.append((floor[:, None] + scale * block[:, 4 : 4 + vocab]).astype(np.float32))
        floors.append(floor.astype(np.float32))
    return SavedLogProbs(tokens.reshape(chunks, context).copy(), log_probs, floors)
