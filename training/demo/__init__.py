"""How the built-in demo model was trained: corpus, tokenizer, phases, evaluation.

The runtime package keeps only what building and serving the demo needs
(``mlxserve.models.demo``: ``build``, ``spec`` and the shipped ``weights/``); ``train``
writes those weights and is never imported by the server.
"""
