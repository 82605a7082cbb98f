"""``edserve chat`` on the tiny random Mllama (byte-level tokenizer): the text equals the Python
API's; JSON schema and forced tool calls print valid JSON; bad input exits 2 with a message."""

from __future__ import annotations

import json

import pytest

from edserve.cli import main

pytest.importorskip("transformers")
pytest.importorskip("llguidance")

from tests.chat.grammar_helpers import SCHEMA, is_pet  # noqa: E402
from tests.chat.test_tools import WEATHER  # noqa: E402
from tests.models.mllama.chat_tiny import save_byte_chat_tokenizer  # noqa: E402
from tests.models.mllama.hf_tiny import build_hf_tiny, save_hf_tiny, synthetic_image  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_cli")
    save_hf_tiny(build_hf_tiny(), folder)
    save_byte_chat_tokenizer(folder)
    synthetic_image(80, 40).save(folder / "cat.png")
    return folder


def _run(folder, capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(["chat", "--model", str(folder), "--device", "cpu", "--dtype", "float32",
              "--context-length", "2048", *args])
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def test_text_equals_the_python_api(folder, capsys):
    from edserve.chat.chat_api import chat
    from edserve.runtime import build_engine

    code, out, _ = _run(folder, capsys, "--image", str(folder / "cat.png"), "--max-tokens", "8",
                        "describe")
    engine = build_engine(model=str(folder), device="cpu", dtype="float32", context_length=2048)
    ref = chat(engine, [{"role": "user", "content": [
        {"type": "image", "image": str(folder / "cat.png")},
        {"type": "text", "text": "describe"}]}], max_tokens=8)
    assert code == 0 and out == ref.text + "\n"


def test_json_schema_and_forced_tool_call(folder, capsys):
    code, out, _ = _run(folder, capsys, "--image", str(folder / "cat.png"), "--max-tokens", "60",
                        "--json-schema", json.dumps(SCHEMA), "--compact-json", "a pet")
    assert code == 0 and is_pet(json.loads(out))
    tools = folder / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    code, out, _ = _run(folder, capsys, "--tools", str(tools), "--tool-choice", "get_weather",
                        "--compact-json", "--max-tokens", "60", "--output", "json", "weather?")
    result = json.loads(out)
    call = result["tool_calls"][0]["function"]
    assert code == 0 and call["name"] == "get_weather" and result["finish_reason"] == "stop"
    assert json.loads(call["arguments"])["city"] in ("Paris", "Oslo")
    code, out, _ = _run(folder, capsys, "--tools", str(tools), "--tool-choice", "required",
                        "--no-parallel-tool-calls", "--compact-json", "--max-tokens", "80",
                        "--temperature", "1", "--output", "json", "weather?")
    result = json.loads(out)
    assert code == 0 and len(result["tool_calls"]) == 1, result  # one call, then a stop token
    assert result["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_flag_reaches_chat():
    from edserve.chat_cli import _options
    from edserve.cli import build_parser

    parse = build_parser().parse_args
    assert _options(parse(["chat", "--model", "m", "hi"]))["parallel_tool_calls"] is True
    off = parse(["chat", "--model", "m", "--no-parallel-tool-calls", "hi"])
    assert _options(off)["parallel_tool_calls"] is False


@pytest.mark.parametrize("args,needle", [
    (("--json-schema", "{not json", "x"), "--json-schema: neither a JSON file nor inline JSON"),
    (("--json-schema", '{"not": {}}', "x"), "unsupported JSON schema"),
    (("--image", "/no/such.png", "x"), "such.png"),
])
def test_bad_input_exits_2_with_a_message(folder, capsys, args, needle):
    code, out, err = _run(folder, capsys, *args)
    assert code == 2 and needle in err and out == ""


def test_whisper_model_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["chat", "--device", "cpu", "hello"])  # the default model: Whisper tiny.en
    assert info.value.code == 2 and "needs a Llama-3.2-Vision" in capsys.readouterr().err
