"""A chat-shaped request read and checked, whichever API it came by.

Chat completions, Anthropic Messages (and its count_tokens), the Responses API and
``/tokenize`` all open the same way: parse the body, check the model, translate it
to the internal chat request, build the prompt. One function does it so that the
order, and so which error a request with several faults gets, is the same
everywhere: a wrong model is a 404 before anything about the content is judged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from starlette.requests import Request

from mlxserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from mlxserve.server.chat_prompt import ChatPrompt, build_chat_prompt
from mlxserve.server.constraints import after_reasoning, response_format_grammar
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.generation import Prepared
from mlxserve.server.protocol import ChatCompletionRequest
from mlxserve.server.responses_protocol import ResponsesRequest
from mlxserve.server.routes.common import parse_body, runtime_of, sampling_extra
from mlxserve.server.runtime import Runtime

Body = TypeVar("Body", ChatCompletionRequest, MessagesRequest, CountTokensRequest, ResponsesRequest)


def chat_grammar(body: ChatCompletionRequest, prompt: ChatPrompt) -> str | None:
    """The answer's grammar: a forced tool call's, or the response format's."""
    if prompt.grammar is not None:
        return prompt.grammar  # a forced tool call's, reasoning included
    grammar = response_format_grammar(body.response_format)
    if grammar is not None and prompt.reasoning_end is not None:
        grammar = after_reasoning(grammar, prompt.reasoning_end)
    return grammar


@dataclass(frozen=True)
class ChatCall(Generic[Body]):
    """The request as its API sent it, as the internal chat request, and its prompt."""

    runtime: Runtime
    body: Body
    chat: ChatCompletionRequest
    prompt: ChatPrompt

    def extra(self) -> dict[str, Any]:
        """The sampling fields beyond temperature, top_p and seed, and the grammar."""
        extra = sampling_extra(self.chat)
        extra["grammar"] = chat_grammar(self.chat, self.prompt)
        return extra

    def refuse_prefill(self, param: str) -> None:
        """A generating route's check: a conversation that ends with the assistant's
        message asks to continue it (Anthropic's prefill). A chat template would close
        that turn and open a new one, another answer than asked for, so it is a 400
        (DeepSeek-V4's encoder refuses it itself). Counting and tokenizing such a
        conversation is fine: nothing is generated."""
        if self.chat.messages[-1].role == "assistant":
            raise InvalidRequest(
                "the conversation ends with an assistant message: continuing a prefilled "
                "answer is not supported; end with a user, developer or tool message",
                param=param,
            )

    def prepare(
        self,
        *,
        limit_param: str = "max_tokens",
        prompt_param: str = "messages",
        extra: dict[str, Any] | None = None,
    ) -> Prepared:
        """The checked generation of this call, from its internal chat request (the
        limit, temperature, top_p, seed, stops, ignore_eos) and `extra` (by default
        `self.extra()`): every API reads them the same way, whichever it came by."""
        chat = self.chat
        return self.runtime.generations.prepare(
            self.prompt.ids,
            max_tokens=chat.token_limit,
            temperature=chat.temperature,
            top_p=chat.top_p,
            seed=chat.seed,
            stops=chat.stop_strings(),
            ignore_eos=bool(chat.ignore_eos),
            limit_param=limit_param,
            prompt_param=prompt_param,
            extra=self.extra() if extra is None else extra,
        )


async def read_chat(
    request: Request, kind: type[Body], to_chat: Callable[[Body], ChatCompletionRequest]
) -> ChatCall[Body]:
    """Parse, check the model, translate (`to_chat`), build the prompt: in that order."""
    runtime = runtime_of(request)
    body = await parse_body(request, kind)
    runtime.generations.check_model(body.model)
    chat = to_chat(body)
    prompt = build_chat_prompt(chat, runtime.codec, runtime.settings.chat.thinking)
    return ChatCall(runtime, body, chat, prompt)


def as_chat(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """`to_chat` for a body that already is a chat request."""
    return body
