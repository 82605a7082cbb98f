"""CPU modes on the embedded tiny.en: bfloat16 and int8 against float32 on the bundled clips,
config validation, and ``--threads``.

Accuracy bound (README "CPU"): on the bundled English clips (jfk, librivox_0870, cards_005) the
bf16 and int8 texts equal float32's after lower-casing and removing punctuation (int8 changes
jfk's "you, ask" into "you. Ask"). The two espeak clips (German and Spanish speech through the
English-only tiny.en) give hallucinated text that changes under any numeric perturbation:
faster-whisper's own int8 and float32 differ there too; int8 is only checked to decode them.
"""

from __future__ import annotations

import re

import pytest
import torch
from whisper_fixtures import CLIPS, DATA

from edserve.audio.decode import load_audio
from edserve.config import EngineConfig
from edserve.engine.cpu_modes import physical_cores, resolve_threads
from edserve.runtime import build_engine
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import transcribe

OTHER = ["espeak_de", "espeak_es"]
# bfloat16 matmuls are slow on CPUs without native bf16 (CI's: ~10 s a window): float32 and
# bf16 decode the English clips, the compared ones; int8 also the two hallucinated ones
MODE_CLIPS = {"fp32": CLIPS, "bf16": CLIPS, "int8": CLIPS + OTHER}
OPTIONS = TranscribeOptions(language="en", temperatures=(0.0,), timestamps=False)


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w' ]", " ", text.lower()).split()


@pytest.fixture(scope="module")
def audios():
    return {c: load_audio(DATA / f"{c}.wav") for c in CLIPS + OTHER}


@pytest.fixture(scope="module")
def texts(audios):
    """Every mode's text per clip: {mode: {clip: text}}; the engine and KV dtypes checked."""
    modes = {"fp32": {}, "bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}
    out = {}
    for mode, kw in modes.items():
        clips = MODE_CLIPS[mode]
        engine = build_engine(device="cpu", max_running_requests=len(clips), **kw)
        want = torch.bfloat16 if mode == "bf16" else torch.float32
        assert engine.dtype == engine.pools.kv_pool.dtype == want
        assert next(engine.model.parameters()).dtype == want
        results = transcribe(engine, [audios[c] for c in clips], options=OPTIONS)
        out[mode] = {c: r.text for c, r in zip(clips, results, strict=True)}
    return out


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_mode_text_matches_fp32_on_english_clips(texts, mode):
    for clip in CLIPS:
        assert _words(texts[mode][clip]) == _words(texts["fp32"][clip]), clip
    for clip in MODE_CLIPS[mode][len(CLIPS):]:
        assert texts[mode][clip].strip()


def test_int8_engine_quantized_the_model():
    engine = build_engine(device="cpu", quantization="int8", max_running_requests=1)
    assert engine.model.quantization["mode"] == "int8"
    assert engine.model.quantization["linears"] > 0


@pytest.mark.parametrize(("kw", "match"), [
    ({"quantization": "int4"}, "--quantization must be one of"),
    ({"threads": 0}, "--threads must be >= 1"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_int8_needs_float32_compute_and_fails_before_loading():
    with pytest.raises(ValueError, match="--dtype float32"):
        build_engine(device="cpu", dtype="bfloat16", quantization="int8", model="/nonexistent")


def test_threads_applied(monkeypatch):
    before = torch.get_num_threads()
    try:
        engine = build_engine(device="cpu", threads=1, max_running_requests=1)
        assert engine.threads == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("EDSERVE_THREADS", "3")
        assert resolve_threads(None) == 3 and resolve_threads(2) == 2
        monkeypatch.delenv("EDSERVE_THREADS")
        assert resolve_threads(None) == physical_cores()
        assert 1 <= physical_cores() <= (torch.multiprocessing.cpu_count() or 1)
    finally:
        torch.set_num_threads(before)


def test_cli_reports_unsupported_mode_without_traceback(capsys):
    from edserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["transcribe", str(DATA / "jfk.wav"), "--device", "cpu", "--dtype", "bfloat16",
              "--quantization", "int8"])
    assert exit_info.value.code == 2
    assert "edserve: --quantization int8" in capsys.readouterr().err


@pytest.mark.parametrize("features, quantization, want", [
    ({"avx2"}, "none", torch.float32),  # this project's AMD EPYC: bf16 would be emulated
    ({"avx512", "avx2"}, "none", torch.float32),  # AVX-512 without BF16: emulated too
    ({"avx512", "avx512_bf16"}, "none", torch.float32),  # no AMX: bf16 measured slower
    ({"avx512", "amx_tile"}, "none", torch.bfloat16),  # Sapphire Rapids and later
    ({"avx512", "amx_tile"}, "int8", torch.float32),  # int8 linears take fp32 activations
])
def test_dtype_auto_on_cpu(features, quantization, want, monkeypatch):
    from edserve.engine.cpu_modes import auto_cpu_dtype, cpu_features
    from edserve.runtime.settings import resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, quantization, frozenset(features)) == want
    assert auto_cpu_dtype(frozenset(features), quantization) == want
    assert resolve_dtype("float32", cpu, quantization, frozenset(features)) == torch.float32
    here = cpu_features()  # this machine: the capability string is one of the features
    assert torch.backends.cpu.get_cpu_capability().lower() in here
    monkeypatch.setenv("EDSERVE_CPU_AUTO_DTYPE", "float16")  # the tests' override wins
    assert resolve_dtype("auto", cpu) == torch.float16
    monkeypatch.delenv("EDSERVE_CPU_AUTO_DTYPE")
    assert resolve_dtype("auto", cpu) == auto_cpu_dtype(here)
