"""The on-disk format: compressed-tensors packing, tensor names and quantization_config."""
