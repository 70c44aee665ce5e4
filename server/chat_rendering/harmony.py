"""gpt-oss's chat format: a chat request rendered in OpenAI's harmony, not Jinja.

A model whose config says ``model_type: gpt_oss`` (or ``GptOssForCausalLM``) speaks
harmony. Its chat requests are rendered with `openai-harmony` (vocabulary:
`jaxengine/tokenizer/harmony.py`) the way vLLM renders them:

- a system message (harmony's default model identity, today's date, and the request's
  ``reasoning_effort``: low, medium (the default) or high);
- a developer message when the request has system/developer messages (their text, in
  order, as its instructions) or tools (the ``functions`` namespace; left out for
  ``tool_choice: "none"`` with --exclude-tools-when-tool-choice-none);
- user messages; assistant history as an analysis-channel message for its
  ``reasoning_content`` (harmony drops analysis before the last final answer itself),
  one commentary message ``to=functions.NAME`` (``<|constrain|>json``) per tool call,
  and a final-channel message for its content; tool results as messages from
  ``functions.NAME`` (the name of the call their ``tool_call_id`` answers).

Generation stops on harmony's action stop tokens (``<|return|>``, ``<|call|>``); the
output is parsed from token ids by `server/chat_rendering/harmony_output.py`. A "required" or named
``tool_choice`` (a JSON grammar over the whole output, which harmony's headers do not
fit) and images are refused with a 400.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

from jaxengine.tokenizer.harmony import HarmonyVocabError, harmony_encoding
from server.chat_rendering.harmony_output import HarmonyOutputParser, HarmonyReasoningCount
from server.chat_rendering.messages import message_text
from server.chat_rendering.output import ChatOutputParser
from server.errors import APIError
from server.tool_calls import ToolChoice, tool_functions

EFFORTS = ("low", "medium", "high")
FORCED_TOOLS = (
    "tool_choice {!r} is not supported for gpt-oss (harmony) models: use 'auto' or 'none'"
)


def is_harmony_model(hf_config: Any) -> bool:
    """Whether a model speaks harmony: gpt-oss, by model type or architecture."""
    archs = getattr(hf_config, "architectures", None) or ()
    return getattr(hf_config, "model_type", None) == "gpt_oss" or "GptOssForCausalLM" in archs


def engine_speaks_harmony(engine: Any) -> bool:
    """`is_harmony_model` for the served model's config (False when it cannot be read,
    e.g. a test double without a config)."""
    model_config = getattr(getattr(engine, "config", None), "model_config", None)
    if model_config is None or not isinstance(getattr(model_config, "model", None), str):
        return False
    try:
        from jaxengine.loader.hf_config import load_hf_config

        config = load_hf_config(
            model_config.model,
            hf_overrides=model_config.hf_overrides or None,
            trust_remote_code=model_config.trust_remote_code,
        )
    except Exception:  # noqa: BLE001 - a config we cannot read is no gpt-oss model
        return False
    return is_harmony_model(config)


class HarmonyChatFormat:
    """Renders chat requests and builds their output parsers in harmony.

    ``today``: the conversation start date written in the system message (vLLM writes
    the server's current date); a fixed one makes renderings reproducible in tests.
    """

    def __init__(self, today: str | None = None, exclude_tools_when_none: bool = False):
        try:
            self.encoding = harmony_encoding()
        except HarmonyVocabError as e:
            raise APIError(str(e), 500) from None
        self.today = today
        self.exclude_tools_when_none = exclude_tools_when_none

    @functools.cached_property
    def stop_token_ids(self) -> list[int]:
        """``<|return|>`` and ``<|call|>``: an assistant turn ends on either."""
        return list(self.encoding.stop_tokens_for_assistant_actions())

    def check(self, choice: ToolChoice) -> None:
        """400 for what harmony cannot honour: a forced tool choice."""
        if choice.forced:
            raise APIError(FORCED_TOOLS.format(choice.mode), param="tool_choice")

    def render(self, request: Any) -> list[int]:
        """The prompt token ids of a chat request."""
        import openai_harmony as oh

        conversation = oh.Conversation.from_messages(self.messages(request))
        if getattr(request, "add_generation_prompt", True):
            return list(
                self.encoding.render_conversation_for_completion(conversation, oh.Role.ASSISTANT)
            )
        return list(self.encoding.render_conversation(conversation))

    def messages(self, request: Any) -> list[Any]:
        """The request as harmony messages: system, developer, then the conversation."""
        out = [self._system(request)]
        developer = self._developer(request)
        if developer is not None:
            out.append(developer)
        names: dict[str, str] = {}  # tool_call_id -> function name
        for message in request.messages:
            out.extend(self._turn(message, names))
        return out

    def output_parser(self, request: Any, choice: ToolChoice, make_id: Any) -> ChatOutputParser:
        return HarmonyOutputParser(request, choice, self.encoding, make_id)

    def reasoning_counter(self) -> HarmonyReasoningCount:
        """What the Responses API counts ``reasoning_tokens`` with."""
        return HarmonyReasoningCount(self.encoding)

    def _system(self, request: Any) -> Any:
        import openai_harmony as oh

        effort = getattr(request, "reasoning_effort", None) or "medium"
        if effort not in EFFORTS:
            raise APIError(
                f"reasoning_effort must be one of {', '.join(EFFORTS)}, not {effort!r}",
                param="reasoning_effort",
            )
        today = self.today or datetime.date.today().isoformat()
        content = (
            oh.SystemContent.new()
            .with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
            .with_conversation_start_date(today)
        )
        return oh.Message.from_role_and_content(oh.Role.SYSTEM, content)

    def _developer(self, request: Any) -> Any | None:
        import openai_harmony as oh

        instructions = [
            message_text(m) for m in request.messages if m.get("role") in ("system", "developer")
        ]
        tools = tool_functions(getattr(request, "tools", None) or [])
        if self.exclude_tools_when_none and getattr(request, "tool_choice", None) == "none":
            tools = []
        if not instructions and not tools:
            return None
        content = oh.DeveloperContent.new()
        if instructions:
            content = content.with_instructions("\n\n".join(instructions))
        if tools:
            described = [
                oh.ToolDescription.new(f["name"], f.get("description") or "", f.get("parameters"))
                for f in tools
            ]
            content = content.with_function_tools(described)
        return oh.Message.from_role_and_content(oh.Role.DEVELOPER, content)

    def _turn(self, message: dict[str, Any], names: dict[str, str]) -> list[Any]:
        """One chat message as harmony messages (system/developer went into the
        developer message)."""
        import openai_harmony as oh

        role = message.get("role")
        if _has_images(message):
            raise APIError("gpt-oss (harmony) models take no images", param="messages")
        text = message_text(message)
        if role in ("system", "developer"):
            return []
        if role == "user":
            return [oh.Message.from_role_and_content(oh.Role.USER, text)]
        if role == "assistant":
            return self._assistant(message, text, names)
        if role == "tool":
            name = names.get(message.get("tool_call_id") or "") or message.get("name")
            if not name:
                raise APIError(
                    "a tool message's tool_call_id must name an earlier assistant tool call",
                    param="messages",
                )
            author = oh.Author.new(oh.Role.TOOL, f"functions.{name}")
            reply = oh.Message.from_author_and_content(author, text)
            return [reply.with_channel("commentary").with_recipient("assistant")]
        raise APIError(f"message role {role!r} is not supported", param="messages")

    def _assistant(self, message: dict, text: str, names: dict[str, str]) -> list[Any]:
        import openai_harmony as oh

        out = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            out.append(_assistant_text(reasoning).with_channel("analysis"))
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            name, arguments = function.get("name"), function.get("arguments") or "{}"
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            names[call.get("id") or ""] = name
            msg = oh.Message.from_role_and_content(oh.Role.ASSISTANT, arguments)
            out.append(
                msg.with_channel("commentary")
                .with_recipient(f"functions.{name}")
                .with_content_type("<|constrain|>json")
            )
        if text:
            out.append(_assistant_text(text).with_channel("final"))
        return out


def _assistant_text(text: str) -> Any:
    import openai_harmony as oh

    return oh.Message.from_role_and_content(oh.Role.ASSISTANT, text)


def _has_images(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") not in ("text", "input_text") for p in content
    )
