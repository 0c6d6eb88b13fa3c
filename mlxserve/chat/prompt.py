"""A chat prompt, and what building one needs of the model's tokenizer.

The prompt is the text and token ids the engine sees, with how its answer is read
back: where the reasoning the prompt opened ends, and the parser of the answer's
tool calls. A forced tool call (``tool_choice`` required or named) is described
here (`ForcedCalls`); the server writes and checks its grammar.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from mlxserve.chat.call_grammar import ToolStyle
from mlxserve.chat.deepseek_v4.encoding import DeepSeekRelease
from mlxserve.chat.request import Function
from mlxserve.chat.tool_calls import ToolCallParser

#: How a model's chat prompts are built: its chat template, DeepSeek-V4's encoder, or
#: a plain transcript (`ChatTokenizer.prompt_format`).
PromptFormat = Literal["template", "deepseek_v4", "transcript"]

#: How a prompt's text becomes its token ids (the tokenizer's `text_ids`, or a
#: generating route's, which first refuses a text too large to fit).
Encode = Callable[[str], list[int]]

#: A function a forced call may call, and the field its parameters came in
#: (``tools.1.function.parameters``): the one a 400 about its schema names.
ForcedTool = tuple[str, Function]


class ChatTokenizer(Protocol):
    """What the formats need of the model's tokenizer (the server's `FrontTokenizer`)."""

    @property
    def has_chat_template(self) -> bool: ...
    @property
    def prompt_format(self) -> PromptFormat: ...
    @property
    def think_markers(self) -> tuple[str, str] | None: ...
    @property
    def tool_markers(self) -> tuple[str, str, Any] | None: ...
    @property
    def tool_parser_name(self) -> str | None: ...
    @property
    def deepseek_release(self) -> DeepSeekRelease: ...
    def template_text(self, messages: list[dict[str, Any]], **kwargs: Any) -> str: ...
    def text_ids(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ForcedCalls:
    """The calls a forced answer must make, in the format's call syntax."""

    style: ToolStyle
    #: The functions one of which each call names.
    tools: tuple[ForcedTool, ...]
    #: Several calls may follow one another (``parallel_tool_calls``).
    parallel: bool


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    text: str
    #: The marker that ends the reasoning the prompt opened; None: no reasoning part.
    reasoning_end: str | None = None
    #: The reasoning's most tokens, its end marker included (``thinking.budget_tokens``);
    #: None: unbounded.
    reasoning_budget: int | None = None
    #: A new parser for the answer's tool calls; None: the answer is all text.
    tool_parser: Callable[[], ToolCallParser] | None = None
    #: The calls tool_choice forces (required or named); None: the model chooses.
    forced: ForcedCalls | None = None
    #: The grammar of the forced calls, reasoning included, as the server wrote and
    #: checked it (`mlxserve.server.chat_request`); None: free.
    grammar: str | None = None
