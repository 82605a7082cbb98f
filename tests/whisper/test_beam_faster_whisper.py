"""Beam search against faster-whisper / CTranslate2 on the SAME CTranslate2 files (the embedded
tiny.en folder), beam 5, temperature 0, no timestamps, English.

Two comparisons:

- whole pipelines: faster-whisper's ``transcribe`` vs edserve's ``transcribe``, joined text;
- beam search alone: the CTranslate2 model faster-whisper loaded, fed edserve's own log-mel,
  vs the engine's beam search on that log-mel (same input, so only the search can differ).

Known, explained differences (not engine bugs; the clip's test xfails with both texts):

- feature padding: faster-whisper (like openai-whisper's ``transcribe``) fills a short
  window's log-mel past the clip's end with zeros; edserve deliberately takes the log-mel of the
  audio followed by silence (see ``LongformTask.next_request``). The encoder input differs past
  the clip's end, so on jfk ("you, ask" vs "you. Ask") and espeak_de the text differs; fed
  edserve's log-mel, CTranslate2 gives edserve's text.
- the search: CTranslate2 ranks the top ``2 * beam`` candidates of all beams and registers an
  end-of-text candidate only when it ranks within the first ``beam`` of them (then refills the
  beam from the rest); openai-whisper collects every end-of-text candidate ranked above the
  ``beam``-th live one and stops as soon as ``beam`` are finished. CTranslate2 thus often
  searches longer. Its scores are the same (sum logprob / length, end-of-text logprob included,
  its length excluded): on espeak_es it finds a sequence of better normalised score one step
  after openai-whisper's rule (and edserve, and the oracle of ``reference_beam.py``) stopped.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from whisper_fixtures import CLIPS, DATA, tiny_en_folder

from edserve.audio.decode import load_audio
from edserve.audio.mel import whisper_features
from edserve.engine.request import GenerateRequest, SamplingParams
from edserve.runtime import build_engine
from edserve.whisper import logits as engine_filters
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import transcribe

pytest.importorskip("faster_whisper")

ALL_CLIPS = [*CLIPS, "espeak_de", "espeak_es"]
BEAM = 5
PROMPT = [50257, 50362]  # <|startoftranscript|><|notimestamps|>
FEATURE_PADDING = ("faster-whisper fills the window's log-mel past the clip with zeros; "
                   "edserve takes the log-mel of the audio + silence")
CT2_SEARCH = ("CTranslate2's beam search registers end-of-text candidates only within the top "
              "beam of its 2*beam candidates and searches longer than openai-whisper's rule")
# clip -> why the whole pipelines differ
PIPELINE_DIFFERS = {"jfk": FEATURE_PADDING, "espeak_de": FEATURE_PADDING,
                    "espeak_es": FEATURE_PADDING + "; and " + CT2_SEARCH}
# clip -> why CTranslate2 on edserve's features differs from the engine
SEARCH_DIFFERS = {"espeak_es": CT2_SEARCH}


@pytest.fixture(scope="module")
def fw_model():
    from faster_whisper import WhisperModel

    # the worker's torch thread count (tests/conftest.py): CTranslate2's default 4 threads
    # would oversubscribe the cores shared with the other pytest -n workers
    return WhisperModel(str(tiny_en_folder()), device="cpu", compute_type="float32",
                        cpu_threads=torch.get_num_threads())


@pytest.fixture(scope="module")
def engine():
    return build_engine(model=str(tiny_en_folder()), device="cpu", max_running_requests=16)


@pytest.fixture(scope="module")
def audios():
    return {c: load_audio(DATA / f"{c}.wav") for c in ALL_CLIPS}


@pytest.fixture(scope="module")
def edserve_texts(engine, audios):
    opts = TranscribeOptions(beam_size=BEAM, language="en", temperatures=(0.0,))
    results = transcribe(engine, [audios[c] for c in ALL_CLIPS], options=opts)
    return {c: r.text.strip() for c, r in zip(ALL_CLIPS, results, strict=True)}


def _compare(clip: str, theirs: str, ours: str, known: dict[str, str]) -> None:
    print(f"{clip}:\n  faster-whisper: {theirs!r}\n  edserve:        {ours!r}")
    if theirs != ours and clip in known:
        pytest.xfail(f"{clip}: {known[clip]}: {theirs!r} vs {ours!r}")
    assert ours == theirs


@pytest.mark.parametrize("clip", ALL_CLIPS)
def test_transcript_matches_faster_whisper(fw_model, audios, edserve_texts, clip):
    """Whole pipelines on the same CT2 weights, beam 5: the same text (except the explained
    clips of ``PIPELINE_DIFFERS``)."""
    segments, _ = fw_model.transcribe(
        audios[clip], beam_size=BEAM, temperature=0.0, without_timestamps=True,
        condition_on_previous_text=False, language="en", vad_filter=False)
    theirs = "".join(s.text for s in segments).strip()
    _compare(clip, theirs, edserve_texts[clip], PIPELINE_DIFFERS)


@pytest.mark.parametrize("clip", ALL_CLIPS)
def test_ctranslate2_beam_search_on_edserve_features(fw_model, engine, audios, clip):
    """Same log-mel into both: CTranslate2's beam search (patience 1, length penalty 1 =
    divide by length) and the engine's give the same tokens and the same normalised score
    (except the explained clips of ``SEARCH_DIFFERS``)."""
    import ctranslate2

    mel = whisper_features(audios[clip], 80)
    feats = ctranslate2.StorageView.from_array(np.ascontiguousarray(mel[None].numpy(),
                                                                    dtype=np.float32))
    [res] = fw_model.model.generate(
        feats, [PROMPT], beam_size=BEAM, patience=1, length_penalty=1, max_length=224,
        return_scores=True, suppress_blank=True, suppress_tokens=[-1])
    tok = engine.tokenizer
    filters = [engine_filters.SuppressBlank.of(tok),
               engine_filters.SuppressTokens.of(engine_filters.default_suppress_tokens(tok))]
    [out] = engine.generate([GenerateRequest(
        list(PROMPT), mel.to(torch.float32), SamplingParams(beam_size=BEAM, max_new_tokens=224),
        logits_processors=filters)])
    theirs = res.sequences_ids[0]
    _compare(clip, tok.decode(theirs), tok.decode(out.token_ids), SEARCH_DIFFERS)
    assert out.token_ids == theirs
    ours_score = (out.sum_logprob + (out.stop_logprob or 0.0)) / len(out.token_ids)
    assert ours_score == pytest.approx(res.scores[0], abs=1e-3)
