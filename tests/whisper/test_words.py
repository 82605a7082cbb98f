"""Word timestamps end to end on tiny.en (the bundled clips): the engine's words against an
independent float64 reference (frame-by-frame median filter, cell-by-cell DTW, its own word
split) on
the same cross-attention weights and on HF transformers' weights; words concatenate to the
segment texts; the output formats carry them."""

from __future__ import annotations

import json
import string

import numpy as np
import pytest
import torch

from edserve.audio.decode import load_audio
from edserve.whisper.alignment import find_alignment
from edserve.whisper.formats import to_json, verbose_dict
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import make_task, run_tasks
from tests.whisper.test_alignment import _dtw_reference
from tests.whisper_fixtures import CLIPS, DATA

TOL = 0.02 + 1e-9  # seconds: one encoder frame


def record_alignments(task) -> list:
    """Keep (sot_seq, text_tokens, alignment) of every window the engine returns to ``task``
    (the output's ``readout``)."""
    calls, feed = [], task.feed

    def recording(out):
        if out.readout is not None:
            calls.append((out.readout.sot_seq, out.readout.text_tokens, out.readout))
        return feed(out)

    task.feed = recording
    return calls


@pytest.fixture(scope="module")
def engine():
    from edserve.runtime import build_engine

    return build_engine(device="cpu", max_running_requests=4)


@pytest.fixture(scope="module")
def runs(engine):
    opts = TranscribeOptions(word_timestamps=True)
    tasks = [make_task(engine, load_audio(DATA / f"{c}.wav"), opts, c) for c in CLIPS]
    for t in tasks:
        t.calls = record_alignments(t)
    run_tasks(engine, tasks)
    return {c: t for c, t in zip(CLIPS, tasks, strict=True)}


def _median7(x: np.ndarray) -> np.ndarray:
    """Median of 7 along the last axis, frame by frame, edges reflected (d c b | a b c d)."""
    n = x.shape[-1]
    out = np.empty_like(x)
    for f in range(n):
        idx = [abs(i) if i < 0 else 2 * (n - 1) - i if i >= n else i
               for i in range(f - 3, f + 4)]
        out[..., f] = np.median(x[..., idx], axis=-1)
    return out


def reference_words(weights: np.ndarray, tok, text: list[int], sot_len: int,
                    num_frames: int) -> list[tuple[str, float, float]]:
    """openai-whisper's find_alignment, written out again in float64."""
    w = np.asarray(weights, dtype=np.float64)[:, :, :num_frames // 2]
    w = w / w.sum(axis=-1, keepdims=True)  # = softmax over the kept frames
    w = (w - w.mean(axis=1, keepdims=True)) / w.std(axis=1, keepdims=True)
    w = _median7(w)
    matrix = w.mean(axis=0)[sot_len - 1:-1]
    text_idx, time_idx = map(np.array, _dtw_reference(-matrix))
    groups: list[list[int]] = []
    for t in text + [tok.eot]:
        piece = tok.decode([t])
        if not groups or t >= tok.eot or piece.startswith(" ") \
                or piece.strip() in string.punctuation:
            groups.append([t])
        else:
            groups[-1].append(t)
    firsts = np.cumsum([0] + [len(g) for g in groups])  # token index where each word starts
    entry = {int(i): int(time_idx[k]) for k, i in reversed(list(enumerate(text_idx)))}
    times = [entry[int(i)] / 50 for i in firsts[:-1]]
    return [(tok.decode(g), times[n], times[n + 1]) for n, g in enumerate(groups[:-1])]


def _raw(task, sot, text, al):
    return find_alignment(al.weights.numpy(), task.tok, text, len(sot),
                          task.content_frames, task.language, al.text_probs)


@pytest.mark.parametrize("clip", CLIPS)
def test_words_match_the_float64_reference(runs, clip):
    task = runs[clip]
    [(sot, text, al)] = task.calls  # one window
    ours = _raw(task, sot, text, al)
    ref = reference_words(al.weights.numpy(), task.tok, text, len(sot), task.content_frames)
    assert [w.word for w in ours] == [r[0] for r in ref]
    for w, (_, start, end) in zip(ours, ref, strict=True):
        assert abs(w.start - start) <= TOL and abs(w.end - end) <= TOL, (w, start, end)
        assert 0.0 < w.probability <= 1.0


@pytest.fixture(scope="module")
def hf_tiny():
    from edserve.models.weights import load_checkpoint
    from tests.whisper.test_cross_weights import _hf

    ckpt = load_checkpoint(None)
    return _hf(ckpt.config, ckpt.state_dict)


@pytest.mark.parametrize("clip", CLIPS)
def test_words_match_the_reference_on_hf_weights(runs, hf_tiny, clip):
    from tests.whisper.test_cross_weights import _hf_cross

    task = runs[clip]
    [(sot, text, al)] = task.calls
    heads = task.aligner.heads
    cross, _ = _hf_cross(hf_tiny, task.mel[:, :3000], sot + text + [task.tok.eot])
    hf_weights = torch.stack([cross[layer][h] for layer, h in heads]).numpy()
    ref = reference_words(hf_weights, task.tok, text, len(sot), task.content_frames)
    ours = _raw(task, sot, text, al)
    assert [w.word for w in ours] == [r[0] for r in ref]
    for w, (_, start, end) in zip(ours, ref, strict=True):
        assert abs(w.start - start) <= TOL and abs(w.end - end) <= TOL, (w, start, end)


@pytest.mark.parametrize("clip", CLIPS)
def test_words_concatenate_to_the_text(runs, clip):
    result = runs[clip].result()
    assert result.words and result.segments
    for s in result.segments:
        assert "".join(w.word for w in s.words) == s.text
        assert s.start == pytest.approx(s.words[0].start) or s.start > s.words[0].start
        for w in s.words:
            assert 0.0 <= w.start <= w.end <= result.duration + 0.01
    assert "".join(w.word for w in result.words).strip() == result.text
    starts = [w.start for w in result.words]
    assert starts == sorted(starts)


def test_formats_carry_words(runs):
    result = runs["jfk"].result()
    line = json.loads(to_json(result))
    assert "".join(w["word"] for w in line["words"]).strip() == result.text
    assert all(0 < w["probability"] <= 1 for w in line["words"])
    body = verbose_dict(result)
    assert [w["word"] for w in body["words"]][:3] == ["And", "so", "my"]
    assert set(body["words"][0]) == {"word", "start", "end"}
    plain = runs["jfk"].result()
    plain.words = None
    assert "words" not in verbose_dict(plain) and "words" not in json.loads(to_json(plain))


def test_cli_word_timestamps(capsys):
    from edserve.cli import main

    with pytest.raises(SystemExit) as info:
        main(["transcribe", str(DATA / "cards_005.wav"), "--word-timestamps",
              "--output-format", "json"])
    assert info.value.code == 0
    line = json.loads(capsys.readouterr().out)
    assert "".join(w["word"] for w in line["words"]).strip() == line["text"]
    assert line["words"][-1]["end"] == line["segments"][-1]["end"]
