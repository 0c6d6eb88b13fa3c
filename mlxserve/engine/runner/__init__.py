"""Running a step on the model: the runner, batch state, caches and model adapters."""
