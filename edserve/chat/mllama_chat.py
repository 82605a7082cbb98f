"""Llama-3.2-Vision Instruct chat: OpenAI-style messages -> prompt ids + images.

The prompt is the Instruct chat template (HF ``chat_template.json`` of Llama-3.2-11B-Vision-
Instruct), rendered to text and tokenized with the special tokens split out, exactly as
``processor.apply_chat_template`` + ``processor(..., add_special_tokens=False)`` do:

* ``<|begin_of_text|>``, then for every message ``<|start_header_id|>{role}<|end_header_id|>``
  ``\\n\\n`` + its content (text parts verbatim, one ``<|image|>`` per image part) +
  ``<|eot_id|>``; finally ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``.
* With images there is no system block, and a (non-empty) system message is an error
  ("Prompting with images is incompatible with system messages"). This module is a little
  stricter than HF: HF only checks the *first* message; any system message with images is
  refused here.
* Without images a system block is emitted first: ``Cutting Knowledge Date: December 2023``,
  ``Today Date: {date}``, then the first system message's content (trimmed). HF fills the date
  with today's date; the default here is the template's fixed fallback ``26 Jul 2024`` so the
  same request always gives the same tokens (pass ``date_string`` to change it).

Message content is a string or a list of parts: ``{"type": "text", "text": ...}``, ``{"type":
"image_url", "image_url": {"url": "data:..."}}`` (OpenAI) or, from Python only, ``{"type":
"image", "image": <PIL image | bytes | path | data: URL>}``. Roles: ``system`` (``developer`` is
an alias), ``user``, ``assistant`` (with ``tool_calls``: written as the model's JSON calls
alone, as Llama 3's template does, its text left out), ``tool`` (a function's result, an
``ipython`` turn). With ``tools`` the functions are listed before the first user message's
content and the system block starts with ``Environment: ipython`` (Llama 3's JSON tool-calling
prompt: :mod:`edserve.chat.tools`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edserve.chat import tools as tool_format
from edserve.chat.errors import ChatFormatError
from edserve.multimodal.errors import ImageInputError
from edserve.multimodal.image_io import ImageSource
from edserve.token_bytes import token_bytes

BOT, EOT = "<|begin_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
IMAGE = "<|image|>"
STOP_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")  # 128001, 128008, 128009
DEFAULT_DATE = "26 Jul 2024"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "ipython", "ipython": "ipython"}  # a tool's result is an ipython turn


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` with the Llama-3 chat special tokens.

    ``encode`` splits special tokens out of the text (no BOS is added: the template has it);
    ``decode`` drops special tokens. ``stop_token_ids``: ``<|end_of_text|>``, ``<|eom_id|>``,
    ``<|eot_id|>`` (those the vocabulary has) plus the model's own end-of-text ids.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int] = (),
                 image_token_id: int | None = None) -> None:
        if tokenizer is None:
            raise ValueError("the model folder has no tokenizer.json; chat needs one")
        missing = [t for t in (BOT, EOT, HEADER_START, HEADER_END, IMAGE)
                   if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer.json lacks the Llama-3 chat special tokens {missing}")
        if image_token_id is not None and tokenizer.token_to_id(IMAGE) != image_token_id:
            raise ValueError(f"tokenizer maps {IMAGE} to {tokenizer.token_to_id(IMAGE)} but the "
                             f"model's image token is {image_token_id}")
        self.tokenizer = tokenizer
        stops = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
        self.stop_token_ids = tuple(dict.fromkeys(
            [int(i) for i in stops if i is not None] + [int(i) for i in eos_token_ids]))

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any) -> ChatTokenizer:
        """For an ``MllamaModel`` and the tokenizer its loader returned."""
        return cls(tokenizer, model.config.stop_token_ids, model.image_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes (:func:`edserve.token_bytes.token_bytes`)."""
        return token_bytes(self.tokenizer, token)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: template text and the images in ``<|image|>`` order."""

    text: str
    images: list[ImageSource]


def _image_source(part: dict, where: str, allow_local: bool) -> ImageSource:
    if part["type"] == "image":
        if not allow_local:
            raise ChatFormatError(f"{where}: use type 'image_url' with a data: URL", where)
        if part.get("image") is None:
            raise ChatFormatError(f"{where}: 'image' part without an 'image' field", where)
        return part["image"]
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ChatFormatError(f"{where}.image_url.url must be a non-empty string", where)
    low = url[:8].lower()
    if not allow_local and not low.startswith(("data:", "http://", "https://")):
        raise ImageInputError("image_url must be a data: URL (data:image/png;base64,...); "
                              "file paths and other schemes are refused")
    return url  # http(s) URLs are refused by load_image with a clear message


def _content(msg: Any, i: int, images: list[ImageSource], allow_local: bool) -> str:
    calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
    if calls:
        if not isinstance(calls, list):
            raise ChatFormatError(f"messages[{i}].tool_calls must be a list",
                                  f"messages[{i}].tool_calls")
        # Llama 3's template writes such a turn as its calls alone (no slot for its text)
        return "; ".join(tool_format.history_call(c, f"messages[{i}].tool_calls[{k}]")
                         for k, c in enumerate(calls))
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if content is None and msg.get("role") == "assistant":
        return ""
    if not isinstance(content, list):
        raise ChatFormatError(f"messages[{i}].content must be a string or a list of parts",
                              f"messages[{i}].content")
    out = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}.text must be a string", where)
            out.append(part["text"])
        elif kind in ("image_url", "image"):
            images.append(_image_source(part, where, allow_local))
            out.append(IMAGE)
        else:
            raise ChatFormatError(f"{where}: unsupported content part type {kind!r:.40} (use "
                                  "'text' or 'image_url')", where)
    return "".join(out)


def render_chat(messages: Sequence[Any], date_string: str = DEFAULT_DATE,
                allow_local_images: bool = True, tools: Sequence[dict] = ()) -> ChatPrompt:
    """The Instruct template applied to ``messages`` (with the generation prompt);
    ``tools``: the function objects to list (:func:`edserve.chat.tools.tools_preamble`).

    Raises :class:`ChatFormatError` for malformed messages or a system message alongside
    images, :class:`ImageInputError` for a non-``data:`` image URL when
    ``allow_local_images`` is False (the server's setting: clients never name local files).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("'messages' must be a non-empty list of messages")
    images: list[ImageSource] = []
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatFormatError(f"messages[{i}] must be an object with 'role' and 'content'",
                                  f"messages[{i}]")
        raw_role = msg.get("role")
        role = ROLES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            shown = repr(raw_role) if isinstance(raw_role, str) and len(raw_role) <= 32 \
                else f"a {type(raw_role).__name__}" if not isinstance(raw_role, str) \
                else repr(raw_role[:32] + "...")
            raise ChatFormatError(f"messages[{i}].role must be one of system, user, assistant, "
                                  f"tool; got {shown}", f"messages[{i}].role")
        turns.append((role, _content(msg, i, images, allow_local_images)))
    system = ""
    if turns[0][0] == "system":
        system = turns.pop(0)[1].strip()
    if images and (system or any(r == "system" and c.strip() for r, c in turns)):
        raise ChatFormatError("Prompting with images is incompatible with system messages: "
                              "put the instructions in the user message")
    if tools:
        first = next((k for k, (r, _) in enumerate(turns) if r == "user"), None)
        if first is None:
            raise ChatFormatError("'tools' need a user message to list them in")
        turns[first] = ("user", tool_format.tools_preamble(tools) + turns[first][1])
    parts = [BOT]
    if not images:
        env = tool_format.ENVIRONMENT if tools else ""
        parts.append(f"{HEADER_START}system{HEADER_END}\n\n{env}Cutting Knowledge Date: "
                     f"December 2023\nToday Date: {date_string}\n\n{system}{EOT}")
    for role, content in turns:
        parts.append(f"{HEADER_START}{role}{HEADER_END}\n\n{content}{EOT}")
    parts.append(f"{HEADER_START}assistant{HEADER_END}\n\n")
    return ChatPrompt("".join(parts), images)


def chat_prompt_ids(tokenizer: ChatTokenizer, messages: Sequence[Any],
                    date_string: str = DEFAULT_DATE, allow_local_images: bool = True,
                    tools: Sequence[dict] = ()) -> tuple[list[int], list[ImageSource]]:
    """Prompt ids and images of ``messages`` (see :func:`render_chat`)."""
    prompt = render_chat(messages, date_string, allow_local_images, tools)
    return tokenizer.encode(prompt.text), prompt.images
