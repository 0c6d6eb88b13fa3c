"""Training code beside the runtime package: it makes shipped artefacts; serving never imports it.

Run from the repository root (``python -m training.demo.train ...``); the wheel does not
contain this folder.
"""
