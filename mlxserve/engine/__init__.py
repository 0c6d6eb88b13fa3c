"""The inference core: one loop owns the model and runs steps chosen by a scheduler."""
