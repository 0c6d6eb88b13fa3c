"""RunningUsage: the per-chunk usage of ``continuous_usage_stats`` (vLLM's counts)."""

from mlxserve.server.generation import Delta
from mlxserve.server.protocol import ChatCompletionRequest
from mlxserve.server.running_usage import RunningUsage


def test_counts_each_choice_so_far_and_the_last_delta_settles_it() -> None:
    running = RunningUsage(prompt_tokens=7, on=True)
    role = running.of(0)  # the role chunk
    assert role is not None and role.completion_tokens == 0
    running.add(0, Delta("a", new_tokens=2))
    running.add(1, Delta("b", new_tokens=1))
    running.add(0, Delta("c", new_tokens=3))
    first = running.of(0)
    assert first is not None
    assert (first.prompt_tokens, first.completion_tokens, first.total_tokens) == (7, 5, 12)
    # a stop string ends the text: the last delta counts every token generated
    running.add(0, Delta("", finish_reason="stop", prompt_tokens=7, completion_tokens=6))
    last = running.of(0)
    assert last is not None and last.completion_tokens == 6
    second = running.of(1)
    assert second is not None and second.completion_tokens == 1


def test_off_gives_no_usage() -> None:
    running = RunningUsage(prompt_tokens=7, on=False)
    running.add(0, Delta("a", new_tokens=2))
    assert running.of(0) is None


def _body(stream_options: dict[str, bool]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": stream_options,
        }
    )


def test_continuous_needs_include_usage_as_in_vllm() -> None:
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert _body(both).continuous_usage
    assert not _body({"continuous_usage_stats": True}).continuous_usage
    assert not _body({"include_usage": True}).continuous_usage
