"""Running llmq checkpoints: the loader that puts quantized linears on the kernels, greedy
generation, and the timing behind `llmq bench`."""
