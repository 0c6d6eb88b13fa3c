"""Chat formats: a conversation to the prompt a model was trained on, and its answer read back.

The server asks this package for a prompt (`build_prompt`) and for the reader of the
answer (`ChatOutput`, with the prompt's ``tool_parser``). It imports nothing of the
server: requests come as `ChatRequest`, and what a format cannot honour is `Refused`.

- `request`: the chat request as the formats read it.
- `prompt`: the prompt, and what building one needs of the tokenizer.
- `controls`: the controls every format shares (thinking, tools, tool_choice), then
  the model's format:
  - `template`: the model's chat template, or a plain transcript without one;
  - `deepseek_v4`: DeepSeek-V4's encoder (`encoding`), its DSML tool calls (`dsml`),
    and a request through them (`format`); V4.1 as a dialect of them (`dialect`).
- `tool_calls`: what a tool-call parser gives, and mlx-lm's parsers behind it.
- `call_grammar`: a forced tool call as a grammar, per call syntax.
- `output`: the answer split into reasoning, content and tool calls as it streams.
"""

from mlxserve.chat.controls import build_prompt
from mlxserve.chat.output import ChatOutput, Content, Piece, Reasoning
from mlxserve.chat.prompt import ChatPrompt, ChatTokenizer, Encode, ForcedCalls, PromptFormat
from mlxserve.chat.request import (
    Call,
    ChatRequest,
    Function,
    Message,
    NamedTool,
    Refused,
    TemplateKwargs,
)
from mlxserve.chat.tool_calls import ParsedToolCall, ToolCallParser

__all__ = [
    "Call",
    "ChatOutput",
    "ChatPrompt",
    "ChatRequest",
    "ChatTokenizer",
    "Content",
    "Encode",
    "ForcedCalls",
    "Function",
    "Message",
    "NamedTool",
    "ParsedToolCall",
    "Piece",
    "PromptFormat",
    "Reasoning",
    "Refused",
    "TemplateKwargs",
    "ToolCallParser",
    "build_prompt",
]
