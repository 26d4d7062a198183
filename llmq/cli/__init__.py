"""The `llmq` command line: one module per command, each a thin layer over `llmq.api`."""
