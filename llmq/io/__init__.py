"""Checkpoint discovery and reading, the family layer table and atomic writes."""
