"""Evaluation: token perplexity over held-out text, streamed one layer at a time, and gates."""
