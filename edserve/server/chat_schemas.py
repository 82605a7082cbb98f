"""``/v1/chat/completions`` shapes as pydantic models, used only to write the OpenAPI document
(``chat.py`` parses the body by hand; see :mod:`edserve.server.schemas`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edserve.chat.chat_api import MAX_STOP_STRINGS
from edserve.engine.request import MAX_TOP_LOGPROBS
from edserve.server.schemas import _Closed

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str = Field(description="A `data:image/...;base64,...` URL (no remote URLs).")


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments: a JSON object, as text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "ipython"] = Field(
        description="`developer` is read as `system`; `tool` (or Llama's `ipython`): a "
        "function's result.")
    content: str | list[TextPart | ImagePart] | None = Field(
        description="A string or a list of parts; null only for `assistant`.")
    tool_calls: list[ToolCall] | None = Field(None, description=(
        "`assistant` only: the calls it made (written in the prompt as Llama 3 JSON calls)."))
    tool_call_id: str | None = Field(None, description="`tool` only (not used by the prompt).")


class FunctionSpec(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description=(
        "JSON Schema of the arguments (absent: none). Forced calls are constrained to it."))


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send one last chunk with `usage`.")


class JsonSchemaFormat(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description=(
        "The JSON Schema the output follows (default: any JSON object). Enforced whatever "
        "`strict` says; keywords the grammar engine does not implement are refused (400)."))
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = Field(description=(
        "`json_object`: the output is one JSON object; `json_schema`: one JSON value valid "
        "against `json_schema.schema` (grammar-constrained decoding)."))
    json_schema: JsonSchemaFormat | None = Field(None, description="For `json_schema`.")


class ChatRequest(BaseModel):
    """The JSON body. Fields not listed are ignored, except those that would change the
    output and are not implemented, refused with 400 when set (the deprecated `functions`,
    `function_call`). A Whisper server answers every chat request with 400
    (`unsupported_task`)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(description="The served model id (--served-model-name); any other: 404.")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1,
                                              description="Takes precedence over max_tokens.")
    temperature: float | None = Field(None, ge=0, le=2, description="Default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Default 1.")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP_STRINGS, description=(
        f"Non-empty string(s), at most {MAX_STOP_STRINGS}; the text ends before the first."))
    stream: bool | None = Field(None, description="Server-sent chunks, then `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=16, description=(
        "Choices (default 1); each is its own engine request (with an image they share one "
        "vision-encoder run); seeded choices use seed + index."))
    logit_bias: dict[str, float] | None = Field(None, description=(
        "Token id (decimal string) -> a bias in [-100, 100] added to its logit."))
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description=(
        "Subtracted from a token's logit once per time it was generated so far. Default 0."))
    presence_penalty: float | None = Field(None, ge=-2, le=2, description=(
        "Subtracted from a token's logit once it was generated. Default 0."))
    logprobs: bool | None = Field(None, description="Each generated token's log-probability "
                                  "(before temperature and top-p).")
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128, description=(
        "Functions the model may call (Llama 3 JSON tool calling). Not with a JSON "
        "`response_format`."))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description=(
            "`auto` (default with tools): the model decides; `none`: the functions are left "
            "out of the prompt; `required`: the answer is forced to calls of the listed "
            "functions (one or more, one with `parallel_tool_calls` false); a named function: "
            "to one call of it; arguments valid against the function's `parameters`."))
    parallel_tool_calls: bool | None = Field(None, description=(
        "false: at most one call is returned (`required` forces exactly one). Default true."))
    structured_outputs: dict | None = Field(None, description=(
        "vLLM's constraint object, exactly one of `json` (a JSON Schema), `regex` (the whole "
        "answer matches it), `choice` (a list of strings: the answer is one of them), "
        "`grammar` (Lark, llguidance's dialect), `json_object: true`; "
        "`disable_any_whitespace: true` makes JSON compact. Not with a JSON "
        "`response_format` or tools."))
    guided_json: dict | str | None = Field(None, description="vLLM's older form of "
                                           "`structured_outputs.json`.")
    guided_regex: str | None = Field(None, description="Older form of "
                                     "`structured_outputs.regex`.")
    guided_choice: list[str] | None = Field(None, description="Older form of "
                                            "`structured_outputs.choice`.")
    guided_grammar: str | None = Field(None, description="Older form of "
                                       "`structured_outputs.grammar`.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "With `logprobs: true`: at each token, this many most likely tokens and their "
        "log-probabilities. Default 0."))


class ChatUsage(_Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class OutputToolCall(_Closed):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Closed):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is `tool_calls`.")
    tool_calls: list[OutputToolCall] = Field(None, description="Only when the model called "
                                             "functions.", json_schema_extra={"type": "array"})


class TopLogprob(_Closed):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Closed):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = Field(description=(
        "The `top_logprobs` most likely tokens at this position, best first (empty: none "
        "asked)."))


class ChoiceLogprobs(_Closed):
    content: list[TokenLogprob]
    refusal: None


class ChatChoice(_Closed):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = Field(description="With `logprobs: true`, else null.")
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Closed):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: ChatUsage


class StreamedFunction(_Closed):
    name: str = Field(None, description="In a call's first delta only.")
    arguments: str = Field(description=(
        "The next characters of the call's arguments (`\"\"` in its first delta): the pieces "
        "of one `index` concatenate to the non-streamed answer's `arguments`."))


class StreamedToolCall(_Closed):
    index: int = Field(description="Which call of the answer (0, 1, ...).")
    id: str = Field(None, description="In a call's first delta only.")
    type: Literal["function"] = Field(None, description="In a call's first delta only.")
    function: StreamedFunction


class ChunkDelta(_Closed):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    tool_calls: list[StreamedToolCall] = Field(None, description=(
        "A call in pieces, as it is written: first its `id`, `type` and `name`, then its "
        "`arguments` text piece by piece."), json_schema_extra={"type": "array"})


class ChunkChoice(_Closed):
    index: int
    delta: ChunkDelta = Field(description="The first chunk carries the role, the last none.")
    logprobs: ChoiceLogprobs | None = Field(
        description="With `logprobs: true`: the tokens since the previous chunk, else null.")
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(_Closed):
    """One ``data:`` line of a chat stream; with `stream_options.include_usage` the last
    chunk has no choices and carries `usage`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChunkChoice]
    usage: ChatUsage = Field(None, description="Only on the last chunk, when asked for.",
                             json_schema_extra={"type": "object"})
