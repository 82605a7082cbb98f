"""Guessed languages under an engine worker process (Whisper base on CPU): a window whose
guess the prefill rejects keeps its encoder K/V on the worker, the retry with the detected
language runs there without a second encoder pass, and the result equals the in-process
engine's (text, language, probability); no handle, row or KV slot is left behind."""

from __future__ import annotations

import asyncio

import pytest

from dp.reference import DATA
from edserve.audio.decode import load_audio
from edserve.config import EngineConfig
from edserve.dp.client import DataParallelClient
from edserve.runtime import build_engine
from edserve.whisper.language import LanguageGuess
from edserve.whisper.options import TranscribeOptions
from edserve.whisper.transcribe import make_task, run_tasks, transcribe_async

OPTS = TranscribeOptions(temperatures=(0.0,), max_new_tokens=8)


@pytest.fixture(scope="module")
def client():
    c = DataParallelClient(EngineConfig(model="base", max_running_requests=4), 1).start()
    yield c
    c.shutdown(5.0)


def _in_process(audio):
    engine = build_engine(model="base", device="cpu", max_running_requests=4)
    task = make_task(engine, audio, OPTS, "de", None)
    task.guess = None  # in-row detection: the reference
    run_tasks(engine, [task])
    return task.result()


def test_a_wrong_guess_retries_on_the_worker_with_its_encoder(client):
    audio = load_audio(DATA / "espeak_de.wav")
    ref = _in_process(audio)
    guess = LanguageGuess("en")  # wrong for this clip
    encoded = client.supervisor.call(client.workers[0], "encoder").result(60)["encoded"]
    outputs = []

    async def run():
        task = make_task(client, audio, OPTS, "de", guess)
        async for _ in transcribe_async(client, task, lambda req, out: outputs.append(out)):
            pass
        return task.result()

    got = asyncio.run(run())
    assert (got.text, got.language) == (ref.text, ref.language) == (ref.text, "de")
    assert got.language_probability == pytest.approx(ref.language_probability, abs=1e-5)
    assert guess.code == "de" and (guess.right, guess.wrong) == (0, 1)
    assert [len(o.token_ids) > 0 for o in outputs] == [False, True]  # rejected, then decoded
    after = client.supervisor.call(client.workers[0], "encoder").result(60)
    assert after["encoded"] == encoded + 1 and after["held"] == 0
    report = asyncio.run(client.integrity())
    assert report["ok"] and report["kv_slots_used"] == 0, report
    assert len(client.supervisor.handles) == 0
