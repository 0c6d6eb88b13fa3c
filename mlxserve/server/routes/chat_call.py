"""A chat-shaped request read and checked, whichever API it came by.

Chat completions, Anthropic Messages (and its count_tokens), the Responses API and
``/tokenize`` all open the same way: parse the body, check the model, translate it
to the internal chat request, build the prompt. One function does it so that the
order, and so which error a request with several faults gets, is the same
everywhere: a wrong model is a 404 before anything about the content is judged.

Everything after parsing (the template or encoder, tokenizing, a generating
route's grammar and checks) runs in the runtime's worker threads
(`mlxserve.server.workers`), never on the event loop, which serves every stream.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from starlette.requests import Request

from mlxserve.channel.request import Reasoning
from mlxserve.chat import ChatPrompt
from mlxserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from mlxserve.server.chat_request import chat_prompt
from mlxserve.server.constraints import after_reasoning, response_format_grammar
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.generation import Prepared
from mlxserve.server.protocol import ChatCompletionRequest
from mlxserve.server.responses_protocol import ResponsesRequest
from mlxserve.server.routes.common import off_loop, parse_body, runtime_of, sampling_of
from mlxserve.server.runtime import Runtime
from mlxserve.server.tokenizer import FrontTokenizer

Body = TypeVar("Body", ChatCompletionRequest, MessagesRequest, CountTokensRequest, ResponsesRequest)


def chat_grammar(
    body: ChatCompletionRequest, prompt: ChatPrompt, tokenizer: FrontTokenizer
) -> str | None:
    """The answer's grammar: a forced tool call's, or the response format's (checked
    against the model's tokenizer before admission: a 400 names a bad schema)."""
    if prompt.grammar is not None:
        return prompt.grammar  # a forced tool call's, reasoning included
    grammar = response_format_grammar(body.response_format, tokenizer)
    if grammar is not None and prompt.reasoning_end is not None:
        grammar = after_reasoning(grammar, prompt.reasoning_end, tokenizer, "response_format")
    return grammar


@dataclass(frozen=True)
class ChatCall(Generic[Body]):
    """The request as its API sent it, as the internal chat request, and its prompt."""

    runtime: Runtime
    body: Body
    chat: ChatCompletionRequest
    prompt: ChatPrompt
    #: The field a prompt too long for the context is refused under.
    prompt_param: str = "messages"

    def grammar(self) -> str | None:
        """The answer's grammar (`chat_grammar`); a bad response format is a 400."""
        return chat_grammar(self.chat, self.prompt, self.runtime.tokenizer)

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
        self, grammar: str | None, *, limit_param: str = "max_tokens", logprobs: int | None = None
    ) -> Prepared:
        """The checked generation of this call, from its internal chat request (the
        limit, the sampling, stops, ignore_eos), its `grammar` (`self.grammar()`), the
        reasoning the prompt opened (`reasoning`) and the route's ``logprobs``: every
        API reads them the same way, whichever it came by."""
        chat = self.chat
        return self.runtime.generations.prepare(
            self.prompt.ids,
            max_tokens=chat.token_limit,
            sampling=sampling_of(chat, logprobs),
            stops=chat.stop_strings(),
            grammar=grammar,
            ignore_eos=bool(chat.ignore_eos),
            limit_param=limit_param,
            prompt_param=self.prompt_param,
            reasoning=self.reasoning(grammar),
        )

    def reasoning(self, grammar: str | None) -> Reasoning | None:
        """The reasoning the prompt opened, where the engine must know its end: a
        thinking budget (forced there), or a ``grammar`` that must close before the
        limit (the end marker comes first). Its end marker as the model's tokens."""
        prompt = self.prompt
        if prompt.reasoning_end is None:
            return None
        if grammar is None and prompt.reasoning_budget is None:
            return None
        end = self.runtime.tokenizer.text_ids(prompt.reasoning_end)
        return Reasoning(tuple(end), prompt.reasoning_budget)


async def read_chat(
    request: Request, kind: type[Body], to_chat: Callable[[Body], ChatCompletionRequest]
) -> ChatCall[Body]:
    """Parse, check the model, translate (`to_chat`), build the prompt: in that order.

    For routes that count or show the prompt: it is tokenized whatever its length."""
    body = await parse_body(request, kind)
    return await off_loop(request, open_chat, runtime_of(request), body, to_chat, None)


async def read_generation(
    request: Request,
    kind: type[Body],
    to_chat: Callable[[Body], ChatCompletionRequest],
    prepare: Callable[[ChatCall[Body]], Prepared],
    prompt_param: str = "messages",
) -> tuple[ChatCall[Body], Prepared]:
    """`read_chat` for a generating route, then its own checks and generation
    (`prepare`, in the same worker thread). A prompt that cannot fit the context is
    refused from its size before it is tokenized, under `prompt_param`."""
    runtime = runtime_of(request)
    body = await parse_body(request, kind)
    return await off_loop(request, _generation, runtime, body, to_chat, prepare, prompt_param)


def open_chat(
    runtime: Runtime,
    body: Body,
    to_chat: Callable[[Body], ChatCompletionRequest],
    prompt_param: str | None,
) -> ChatCall[Body]:
    """Check the model, translate, build the prompt (blocking: a worker thread's job).
    `prompt_param` None: no size check (the prompt is counted, not generated from)."""
    runtime.generations.check_model(body.model)
    chat = to_chat(body)
    encode = (
        None
        if prompt_param is None
        else functools.partial(runtime.generations.prompt_ids, param=prompt_param)
    )
    prompt = chat_prompt(chat, runtime.tokenizer, runtime.settings.chat.thinking, encode)
    return ChatCall(runtime, body, chat, prompt, prompt_param or "messages")


def _generation(
    runtime: Runtime,
    body: Body,
    to_chat: Callable[[Body], ChatCompletionRequest],
    prepare: Callable[[ChatCall[Body]], Prepared],
    prompt_param: str,
) -> tuple[ChatCall[Body], Prepared]:
    call = open_chat(runtime, body, to_chat, prompt_param)
    return call, prepare(call)


def as_chat(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """`to_chat` for a body that already is a chat request."""
    return body
