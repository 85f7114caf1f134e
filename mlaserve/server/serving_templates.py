"""Chat templates and the tokenizer routes: `TemplateServing` renders a request's messages
with the model's chat template (or, with --trust-request-chat-template, a request-supplied one
in a sandbox process bounded in time, size and memory: chat_template_sandbox.py) and serves
/tokenize and /detokenize."""

import json

from jinja2 import TemplateError

from mlaserve.server.chat_template_sandbox import RequestTemplateRenderer, TemplateLimitError
from mlaserve.server.protocol_chat import ChatMessage
from mlaserve.server.protocol_extras import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from mlaserve.server.serving_base import APIError, ServingBase


class TemplateServing(ServingBase):
    """The shared steps, plus chat-template rendering and the tokenizer routes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.template_renderer = RequestTemplateRenderer(self.options.chat_template_timeout_s,
                                                         self.max_prompt_chars)

    def close(self) -> None:
        """Stop the request-template renderer's processes."""
        self.template_renderer.close()

    # ---- chat templates -----------------------------------------------------------------
    def check_chat_template(self, template: str | None) -> None:
        if template is not None and not self.options.trust_request_chat_template:
            raise APIError(400, "this server does not accept a chat template in the request "
                           "(start it with --trust-request-chat-template to allow that)",
                           param="chat_template")

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    template: str | None, template_kwargs: dict | None,
                    tools: list[dict] | None = None, continue_final_message: bool = False
                    ) -> str:
        """The chat template's text for these messages (runs in the worker pool).

        The model's own template renders through the tokenizer; a request-supplied one (only
        with --trust-request-chat-template) in a sandbox bounded in time and output size.
        `tools` go to the template as its `tools` variable (as vLLM passes them).
        """
        if not messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        plain = [m.template_message() for m in messages]
        self.check_text(sum(len(m.text()) for m in messages) + len(template or "")
                        + len(json.dumps(tools) if tools else ""), "messages")
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "chat_template"}
        if tools:
            kwargs["tools"] = tools
        if continue_final_message:
            if add_generation_prompt:
                raise APIError(400, "continue_final_message and add_generation_prompt cannot "
                               "both be true", param="continue_final_message")
            if messages[-1].role != "assistant":
                raise APIError(400, "continue_final_message needs a last message of role "
                               "assistant", param="continue_final_message")
        try:
            if template is None:
                return self.tokenizer.apply_chat_template(
                    plain, add_generation_prompt=add_generation_prompt, tokenize=False,
                    continue_final_message=continue_final_message, **kwargs)
            context = {**self.tokenizer.special_tokens_map, **kwargs, "messages": plain,
                       "add_generation_prompt": add_generation_prompt}
            text = self.template_renderer.render(template, context)
            return continued(text, plain[-1]["content"]) if continue_final_message else text
        except TemplateLimitError as exc:
            raise APIError(400, f"the chat template was stopped: {exc}",
                           param="chat_template") from None
        except RecursionError:
            raise APIError(400, "the chat template cannot render these messages: they nest "
                           "too deeply", param="messages") from None
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError,
                ArithmeticError) as exc:
            raise APIError(400, f"the chat template cannot render these messages: {exc}",
                           param="messages") from None

    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                        template: str | None, template_kwargs: dict | None,
                        tools: list[dict] | None = None, continue_final_message: bool = False,
                        add_special_tokens: bool = False) -> list[int]:
        """Render the chat template (which carries BOS) and tokenize (without special tokens
        unless asked)."""
        text = self.render_chat(messages, add_generation_prompt, template, template_kwargs,
                                tools, continue_final_message)
        self.check_text(len(text), "messages")
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    # ---- tokenizer routes ---------------------------------------------------------------
    def _tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        if req.messages is not None:
            ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt,
                                       req.request_chat_template(), req.chat_template_kwargs)
        elif req.prompt is not None:
            self.check_text(len(req.prompt), "prompt")
            ids = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)[
                "input_ids"]
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        token_strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs \
            else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=token_strs)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        self.check_chat_template(req.request_chat_template())
        return await self.in_thread(self._tokenize, req)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = len(self.tokenizer)
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=await self.in_thread(self.tokenizer.decode, req.tokens))


def continued(text: str, final_content: str | None) -> str:
    """A rendered conversation cut right after the last message's content, so the model
    continues that message (continue_final_message with a request-supplied template)."""
    if not final_content:
        return text
    at = text.rfind(final_content)
    return text if at < 0 else text[: at + len(final_content)]
