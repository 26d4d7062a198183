"""Options several commands share, declared once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ModelArg = Annotated[
    str, typer.Argument(help="Checkpoint folder, or a built-in name (`llmq models`).")
]
CalibText = Annotated[
    str,
    typer.Option(
        help="Calibration text: shakespeare, pydoc, news (joined with +), a .txt/.jsonl/.parquet "
        "file, or a dataset in the local HF cache."
    ),
]
Seed = Annotated[int, typer.Option(help="Seed for sampling calibration windows.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
Device = Annotated[
    str,
    typer.Option(help="Where layers run: auto (the GPU when there is one), cpu, cuda or cuda:N."),
]
Dtype = Annotated[
    str,
    typer.Option(
        help="Compute dtype: auto (bfloat16 on a GPU, float32 on the CPU), bfloat16, float16, float32."
    ),
]
Kernels = Annotated[
    str,
    typer.Option(
        help="Quantized linears run: auto (Triton on a GPU, the torch reference on the CPU), "
        "triton (on the CPU only with TRITON_INTERPRET=1), or torch."
    ),
]
SpaceCheck = Annotated[
    bool,
    typer.Option(
        "--space-check/--no-space-check",
        help="Before any work, refuse an output that will not fit in the free space of its file "
        "system. --no-space-check skips this for file systems that report free space wrongly.",
    ),
]

Ignore = Annotated[
    list[str] | None,
    typer.Option(
        help="Linears to leave as they are (not quantized, not pruned): a name or suffix (mlp.down_proj) or a `re:` regular expression matched from the start of the name (`re:.*layers\\.0\\.`); repeatable. A pattern that matches no linear is an error (exit 2). lm_head is always kept."
    ),
]

DampeningFrac = Annotated[
    float,
    typer.Option(
        help="gptq, sparsegpt: added to the Hessian diagonal, as a fraction of its mean, in (0, 1). Raised step by step (and reported) when the Hessian is still not positive definite."
    ),
]

TrueSequential = Annotated[
    bool,
    typer.Option(
        help="gptq, sparsegpt and wanda (and rtn --clip output): process each layer group by group, q/k/v, then o_proj, gate/up, down_proj, each observed after the groups before it are done; about one forward pass a layer, but it holds the attention output and the MLP's intermediate activations of all calibration windows (Llama-3-70B at 128x512 tokens: ~12 GB instead of ~2 GB). --no-true-sequential observes the float layer whole, then runs it again compressed: two passes, less memory. awq, --smooth, static activations and --kv-cache always do the latter."
    ),
]

SparsityOption = Annotated[
    float | None,
    typer.Option(
        help="magnitude, wanda, sparsegpt: the share of each row's weights set to zero, in (0, 1), e.g. 0.5."
    ),
]

PatternOption = Annotated[
    str | None,
    typer.Option(
        help="magnitude, wanda, sparsegpt: N:M sparsity instead, at most N non-zeros in every M consecutive inputs (2:4, 4:8); M must divide every linear's in_features."
    ),
]

CalibStatsPath = Annotated[
    Path | None,
    typer.Option(help="Reuse statistics saved by `llmq calibrate` instead of collecting them."),
]

Overwrite = Annotated[
    bool, typer.Option(help="Replace an existing OUT (only once the new one is complete).")
]

Resume = Annotated[
    bool,
    typer.Option(help="Continue an interrupted run into the same OUT with the same options."),
]

ResumeEvery = Annotated[
    float,
    typer.Option(
        help="Seconds between resume points: the hidden states after a layer, saved for --resume (as large as the calibration activations: 2 GB a layer for a 70B model at 128 x 512 tokens). 0 saves after every layer; an interruption loses at most this much work."
    ),
]

Reference = Annotated[
    bool,
    typer.Option(
        help="Record in llmq.json what the written files compute on three fixed prompts, for `llmq verify` (one more pass over the written layers, a few tokens each). --no-reference skips it; verify then computes it from the files. File hashes are recorded either way."
    ),
]

SeqLen = Annotated[int, typer.Option(help="Tokens per calibration window.")]

SparsityProfile = Annotated[
    str,
    typer.Option(
        help="How --sparsity is spread over the decoder layers: uniform (the same in every layer), owl (outlier-weighed, arXiv 2310.05175: a layer whose weights hold more outliers, |w|·‖x‖ above 5x its mean on the dense model, keeps more of them) or scan (a layer whose pruning loses a larger share of its output, fallback-scan's Σ‖ΔW_:j‖²E[x_j²] with ΔW what the method drops over Σ‖W_:j‖²E[x_j²], keeps more); every layer within ±8 points of --sparsity, the same total; one more calibration pass. The report shows each layer's sparsity."
    ),
]
