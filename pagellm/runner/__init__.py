"""Everything that touches torch at run time: loading, the KV tensors, the model runner."""
