"""Pruning: which weights to remove (masks from scores), for the methods that prune in the
layer pipeline (magnitude, Wanda, SparseGPT in GPTQ's solver)."""
