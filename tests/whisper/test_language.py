"""Language detection in the decoder row (Whisper base, multilingual), against HF transformers
on the same weights; the detection filters on their own; greedy detection while sampling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edserve.audio.decode import load_audio
from edserve.engine.logits_filter import FilterContext
from edserve.engine.sampler import FilterGroup, SamplingPlan, sample
from edserve.engine.token_history import TokenHistory
from edserve.whisper.language import (
    DetectLanguage,
    ForceTokens,
    LanguageGuess,
    Shifted,
    language_name,
)
from edserve.whisper.logits import SuppressBlank
from edserve.whisper.longform import LongformTask
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import transcribe

DATA = Path(__file__).parent.parent / "data"
CLIPS = {"jfk": "en", "librivox_0870": "en", "espeak_de": "de", "espeak_es": "es"}
JFK_EN = ("And so my fellow Americans, ask not what your country can do for you, ask what you "
          "can do for your country.")


@pytest.fixture(scope="module")
def base_engine():
    from edserve.runtime import build_engine

    return build_engine(model="base", device="cpu", max_running_requests=4)


@pytest.fixture(scope="module")
def audios() -> dict[str, np.ndarray]:
    return {name: load_audio(DATA / f"{name}.wav") for name in CLIPS}


@pytest.fixture(scope="module")
def together(base_engine, audios):
    return dict(zip(CLIPS, transcribe(base_engine, list(audios.values()), word_timestamps=True),
                    strict=True))


@pytest.fixture(scope="module")
def hf_base():
    """HF transformers' Whisper on the base checkpoint's weights (CT2 -> HF names), float32."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from edserve.models.weights import load_checkpoint

    ckpt = load_checkpoint("base")
    hf = WhisperForConditionalGeneration(WhisperConfig(**ckpt.config)).eval()
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in ckpt.state_dict.items()},
                                             strict=False)
    assert unexpected == [] and set(missing) <= {"proj_out.weight"}
    return hf


def _hf_detect(hf, engine, audio: np.ndarray) -> tuple[str, float]:
    """openai-whisper's detect_language on HF transformers (float64 softmax over the language
    tokens of the logits at <|startoftranscript|>), from the same first-window features."""
    tok = engine.tokenizer
    mel = LongformTask(audio, tok, 80, TranscribeOptions()).mel[:, :3000]
    with torch.no_grad():
        logits = hf(input_features=mel[None].float(),
                    decoder_input_ids=torch.tensor([[tok.sot]])).logits[0, -1].double()
    ids = [tok.language_token(c) for c in tok.all_language_codes]
    probs = torch.softmax(logits[ids], dim=-1)
    best = int(probs.argmax())
    return tok.all_language_codes[best], float(probs[best])


def test_detection_matches_hf(hf_base, base_engine, audios, together):
    for name, expected in CLIPS.items():
        code, prob = _hf_detect(hf_base, base_engine, audios[name])
        result = together[name]
        assert code == expected == result.language, name
        assert abs(result.language_probability - prob) < 1e-3, (name, prob)


def test_jfk_without_language_is_the_english_text(together):
    assert together["jfk"].text == JFK_EN
    assert together["espeak_es"].text.startswith("Buenos días")


def test_batch_invariance(base_engine, audios, together):
    """Detection and word timestamps: 4 clips decoded together == each alone."""
    for name, audio in audios.items():
        alone = transcribe(base_engine, [audio], word_timestamps=True)[0]
        assert alone.text == together[name].text
        words = [(w.word, w.start, w.end) for w in alone.words]
        assert words and words == [(w.word, w.start, w.end) for w in together[name].words]
        assert "".join(w[0] for w in words).strip() == alone.text
        assert alone.language == together[name].language
        assert alone.language_probability == pytest.approx(together[name].language_probability,
                                                           abs=1e-5)


def test_given_language_is_not_detected(base_engine, audios):
    r = transcribe(base_engine, [audios["jfk"]], language="en")[0]
    assert r.text == JFK_EN and r.language == "en" and r.language_probability is None


def test_detection_stays_greedy_when_sampling(base_engine, audios, together):
    # detection is the first decoder step: one sampled token after it is enough
    r = transcribe(base_engine, [audios["espeak_de"]], options=TranscribeOptions(
        temperatures=(1.0,), seed=3, max_new_tokens=1))[0]
    assert r.language == "de"
    assert r.language_probability == pytest.approx(together["espeak_de"].language_probability,
                                                   abs=1e-5)


def _alone(engine, audio, guess: LanguageGuess | None, **opts):
    """One task driven alone with ``guess`` (None: in-row detection); with the engine's
    decode steps and encoder inputs it took."""
    from edserve.whisper.transcribe import run_tasks

    task = LongformTask(audio, engine.tokenizer, 80, TranscribeOptions(**opts),
                        engine.max_decoder_len, "clip", reuse_encoder=True,
                        language_guess=guess)
    steps0, enc0 = engine.step_counters.snapshot(), engine.runner.num_encoded_inputs
    run_tasks(engine, [task])
    steps = engine.step_counters.snapshot()
    decode = sum(steps[k].steps - steps0[k].steps for k in ("decode", "mixed"))
    return task.result(), decode, engine.runner.num_encoded_inputs - enc0


@pytest.mark.parametrize("name", ["espeak_de", "jfk"])
def test_a_guessed_language_is_checked_by_the_prefill(base_engine, audios, name):
    """A detecting window that guesses right or wrong gives what in-row detection gives (text,
    language, probability); a right guess saves the sot sequence's decode steps, a wrong one
    costs a second prefill but no second encoder pass; the guess learns the language."""
    cap = dict(max_new_tokens=6, temperatures=(0.0,))
    inrow, inrow_steps, inrow_enc = _alone(base_engine, audios[name], None, **cap)
    assert inrow.language == CLIPS[name] and inrow_enc == 1
    for guess in ("en", "de"):
        shared = LanguageGuess(guess)
        got, steps, enc = _alone(base_engine, audios[name], shared, **cap)
        assert (got.text, got.language) == (inrow.text, inrow.language), guess
        assert got.language_probability == pytest.approx(inrow.language_probability, abs=1e-5)
        assert enc == 1 and shared.code == CLIPS[name]
        forced = len(base_engine.tokenizer.sot_sequence(CLIPS[name], "transcribe", False)) - 1
        right = guess == CLIPS[name]
        assert (shared.right, shared.wrong) == ((1, 0) if right else (0, 1))
        # in-row: the language and the rest of the sot sequence take decode steps; a right
        # guess none of them; a wrong one as many as a right one
        assert steps == inrow_steps - forced, (guess, steps, inrow_steps)
        if right:
            assert got.segments[0].tokens == inrow.segments[0].tokens


def test_language_names():
    assert language_name("en") == "english" and language_name("ht") == "haitian creole"
    assert language_name("xx") == "xx"


# ---- the filters alone --------------------------------------------------------------------

def _ctx(lengths: list[int], width: int = 8, greedy: bool = False) -> FilterContext:
    n = len(lengths)
    hist = torch.arange(n * width).view(n, width) % 5 + 100
    g = torch.zeros(n, dtype=torch.bool) if greedy else None
    return FilterContext(hist, torch.tensor(lengths), tuple(f"r{i}" for i in range(n)), g)


def test_detect_language_masks_only_its_step():
    logits = torch.randn(3, 50)
    ref = logits.clone()
    ctx = _ctx([0, 1, 0], greedy=True)
    DetectLanguage((4, 7, 9)).apply(logits, ctx)
    for row in (0, 2):
        finite = torch.isfinite(logits[row]).nonzero()[:, 0].tolist()
        assert finite == [4, 7, 9] and torch.equal(logits[row, finite], ref[row, finite])
    assert torch.equal(logits[1], ref[1])
    assert ctx.greedy.tolist() == [True, False, True]


def test_force_tokens():
    logits = torch.randn(4, 50)
    ref = logits.clone()
    ForceTokens((11, 22), start=1).apply(logits, _ctx([0, 1, 2, 3]))
    assert torch.equal(logits[0], ref[0]) and torch.equal(logits[3], ref[3])
    for row, tok in ((1, 11), (2, 22)):
        assert torch.isfinite(logits[row]).nonzero()[:, 0].tolist() == [tok]


def test_shifted_sees_history_from_begin(tok):
    blank = SuppressBlank.of(tok)
    logits = torch.zeros(3, tok.vocab_size)
    Shifted((blank,), 3).apply(logits, _ctx([2, 3, 5]))
    masked = [bool(torch.isinf(logits[r]).any()) for r in range(3)]
    assert masked == [False, True, False]  # only the row at its shifted first position


def test_sampler_makes_detect_rows_greedy():
    """64 sampled rows at temperature 1 over flat language logits: every row still takes the
    argmax language, and its log-probability is the softmax over the language tokens."""
    n, vocab, ids = 64, 40, (3, 5, 8, 13)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=gen) * 0.1
    history = TokenHistory(n, 4, torch.device("cpu"))
    rows = torch.arange(1, n + 1)
    plan = SamplingPlan([FilterGroup((DetectLanguage(ids),), None, ())], torch.arange(n),
                        torch.ones(n), torch.ones(n),
                        [torch.Generator().manual_seed(i) for i in range(n)])
    tokens, logprobs, _ = sample(logits.clone(), plan, history, rows)
    lang = logits[:, list(ids)]
    expected = torch.tensor(ids)[lang.argmax(dim=1)]
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logprobs, torch.log_softmax(lang, dim=1).amax(dim=1))


def test_outputs_carry_the_language(together):
    import json

    from edserve.whisper.formats import to_json, verbose_dict

    line = json.loads(to_json(together["espeak_de"]))
    assert line["language"] == "de" and 0.5 < line["language_probability"] <= 1.0
    assert verbose_dict(together["espeak_de"])["language"] == "german"


def test_cli_json_detects_the_language(capsys):
    from edserve.cli import main

    with pytest.raises(SystemExit) as info:
        main(["transcribe", str(DATA / "jfk.wav"), "--model", "base", "--output-format", "json"])
    assert info.value.code == 0
    import json

    line = json.loads(capsys.readouterr().out)
    assert line["text"] == JFK_EN and line["language"] == "en"
    assert 0.9 < line["language_probability"] <= 1.0
