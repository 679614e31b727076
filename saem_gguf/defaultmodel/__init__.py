"""The embedded default model: a small qwen3moe trained by us on generated chain-of-thought text.

``corpus`` generates the training text, ``bpe`` trains the byte-level BPE tokenizer, ``model`` /
``train`` / ``export`` (PyTorch, development only) train the model and write the GGUF, and
``reference`` is a NumPy forward pass over a GGUF (no PyTorch) used by the tests. See
docs/DEFAULT_MODEL.md. Nothing here imports torch at package import time.
"""
