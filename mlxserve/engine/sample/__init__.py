"""Turning logits into tokens: sampling, logit transforms, grammars and acceptance."""
