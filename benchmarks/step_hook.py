"""Wrap an engine's `Runner.run` for the length of a `with` block (benchmarks only).

Several benchmarks watch every step the engine runs (its time, its memory peak)
without changing the engine: they put a function around `engine.runner.run` and
must put the original back afterwards, also when the run fails.
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

#: The runner's own `run(plan, sequences)`.
Run = Callable[[Any, Any], Any]
#: What goes around it: called with the original `run`, the plan and the sequences.
Around = Callable[[Run, Any, Any], Any]


@contextlib.contextmanager
def around_steps(engine: Any, around: Around) -> Iterator[None]:
    """Within the block every step goes through ``around(run, plan, sequences)``."""
    runner = engine.runner
    own = "run" in vars(runner)  # already wrapped on the instance: restore that
    original = runner.run
    runner.run = lambda plan, sequences: around(original, plan, sequences)
    try:
        yield
    finally:
        if own:
            runner.run = original
        else:
            del runner.run
