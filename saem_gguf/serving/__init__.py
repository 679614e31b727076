"""Serving several requests at once: the continuous-batching scheduler (``batch``) and the
OpenAI-compatible HTTP server built on it (``protocol``, ``auth``, ``metrics``, ``app``, ``server``)."""
