"""`python -m llmq` (and `torchrun -m llmq distill ...`) runs the CLI."""

from llmq.cli.main import main

main()
