"""`llmq batch`: many models x many recipes, each job `llmq.api.chain.run` in its own process (or
a Ray task), resumable, with one summary. A client above llmq.api, as the CLI is.

    from llmq.batch import run_batch
    result = run_batch("jobs.yaml", "runs/", parallel=2)
"""

from __future__ import annotations

from typing import Any

__all__ = ["BatchResult", "plan_batch", "run_batch", "run_plan"]


def __getattr__(name: str) -> Any:  # lazy: importing llmq.batch stays cheap
    if name in __all__:
        from llmq.batch import run

        return getattr(run, name)
    raise AttributeError(f"module 'llmq.batch' has no attribute {name!r}")
