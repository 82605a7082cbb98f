"""The asynchronous driver of :mod:`edserve.batch_cli`: one coroutine per input file, a
bounded number at once, over any :class:`~edserve.engine.protocol.EngineClient` (one engine,
or data-parallel workers)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from edserve.batch_output import LOST_RETRIES, output_paths, rtf_postfix, write_atomic


class BatchRun:
    """Transcribe files through ``client`` with ``options``; outputs per ``args``."""

    def __init__(self, client: Any, args: Any, options: Any) -> None:
        self.client, self.args, self.options = client, args, options
        from edserve.whisper.language import LanguageGuess

        self.language_guess = LanguageGuess()  # what windows detecting a language guess
        workers = len(getattr(client, "workers", [None]))
        self.limit = max(2, workers * client.config.max_running_requests)
        self.failed = 0
        self.audio_s = 0.0
        self._ready: dict[int, Any] = {}  # stdout mode: results waiting for earlier inputs
        self._next = 0

    async def run(self, files: list[str]) -> int:
        """Transcribe ``files``; 0, or 1 when some input failed."""
        from tqdm import tqdm

        sem = asyncio.Semaphore(self.limit)
        self.started = time.monotonic()
        with tqdm(total=len(files), desc="transcribing", unit="file", file=sys.stderr,
                  disable=len(files) < 2) as self.bar:

            async def one(i: int, path: str) -> None:
                async with sem:
                    result = await self._file(path)
                self._emit(i, result)

            await asyncio.gather(*(one(i, f) for i, f in enumerate(files)))
        return 1 if self.failed else 0

    async def _file(self, path: str) -> Any:
        from edserve.audio.decode import load_audio
        from edserve.audio.errors import AudioError
        from edserve.dp.errors import WorkerLost
        from edserve.engine.errors import RequestFailed
        from edserve.whisper.transcribe import make_task, transcribe_async

        try:
            audio = await asyncio.to_thread(load_audio, path)
        except (AudioError, OSError) as exc:
            return self._error(f"{exc}")
        for attempt in range(LOST_RETRIES + 1):
            try:
                task = make_task(self.client, audio, self.options, path, self.language_guess)
                async for _ in transcribe_async(self.client, task):
                    pass
                result = task.result()
                result.source = path
                return result
            except WorkerLost as exc:
                if attempt == LOST_RETRIES:
                    return self._error(f"{path}: {exc}")
            except (AudioError, ValueError, RequestFailed) as exc:
                return self._error(f"{path}: {exc}")
        return None

    def _error(self, message: str) -> None:
        print(f"edserve: {message}", file=sys.stderr)
        self.failed += 1
        return None

    def _emit(self, i: int, result: Any) -> None:
        from edserve.whisper.formats import FORMATTERS

        fmt, out_dir = self.args.output_format, self.args.output_dir
        if result is not None:
            self.audio_s += result.duration
            if out_dir is not None:
                for f, path in output_paths(result.source, fmt, out_dir).items():
                    write_atomic(path, FORMATTERS[f](result))
        if out_dir is None:
            self._ready[i] = result
            while self._next in self._ready:
                r = self._ready.pop(self._next)
                if r is not None:
                    sys.stdout.write(FORMATTERS[fmt](r))
                    sys.stdout.flush()
                self._next += 1
        self.bar.update(1)
        self.bar.set_postfix(rtf_postfix(self.audio_s, self.started), refresh=False)
