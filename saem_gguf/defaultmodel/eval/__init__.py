"""The held-out evaluation of the default model (docs/DEFAULT_MODEL.md, "Evaluation").

``phrasings`` (questions written apart from the training templates) and ``problems`` (the seeded
sets: single-turn kinds, three-turn conversations, out-of-domain turns) make the questions;
``run`` asks them through saem_gguf's public ``Llama``; ``scoring`` checks each reply against the
model contract; ``report`` tallies by kind and turn; ``stages``, ``routing`` and
``tcseq_baselines`` measure the replies' stages and their stage coherence; ``harness`` runs it all
and ``cli`` is ``python -m saem_gguf.defaultmodel.evaluate``.
"""
