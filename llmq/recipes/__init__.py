"""Recipes: llmq's stages as one YAML file (`schema`: the typed stages; `load`: YAML with line
numbers in every error, and the effective recipe back as YAML). No torch here."""
