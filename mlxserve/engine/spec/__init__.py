"""Speculative decoding: the depth, its costs, drafting under constraints and the MTP head."""
