"""Frozen server configuration; field docs are the ``edserve serve --help`` text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edserve.config import MAX_GROUP_ROWS, MEL_PADDINGS, check_mel_padding

#: ``--http`` values (the protocols: :func:`edserve.server.connections.guarded_protocol`).
HTTP_IMPLS = ("auto", "httptools", "h11")
#: ``--device-features-above-s auto`` on a CUDA engine: uploads longer than one window.
AUTO_DEVICE_FEATURES_S = 30.0
AUTO_DEVICE_FEATURES_IDLE = 2  # --device-features-idle auto on CUDA
#: ``--step-features`` unset: on for these engine device types.
AUTO_STEP_FEATURES: frozenset[str] = frozenset({"cuda"})


DEFAULT_MODEL_NAME = "whisper-1"  # what OpenAI's audio clients send; always accepted for audio


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerConfig:
    """How ``edserve serve`` listens and what it accepts; one instance per server."""

    host: str = _f("127.0.0.1", "Interface to bind (use 0.0.0.0 to listen on every interface).")
    port: int = _f(8000, "TCP port to listen on (0: any free port).")
    api_key: str | None = _f(
        None, "If set, /v1/* requests must send 'Authorization: Bearer KEY' (else 401).")
    served_model_name: str | None = _f(
        None, "Model id reported by /v1/models and accepted in the 'model' field (default: "
        "whisper-1 for a Whisper model, as OpenAI's audio API names it; the --model value for "
        "other models, as vLLM does).")
    max_upload_mb: float = _f(25.0, "Largest accepted upload in MiB (larger: 413).")
    max_audio_seconds: float = _f(3600.0, "Longest accepted audio in seconds (longer: 400).")
    condition_on_previous_text: bool = _f(
        False, "Prompt each 30 s window with the previous window's text (<|startofprev|>); "
        "off by default: small models tend to repeat the prompt.")
    compression_ratio_threshold: float = _f(
        2.4, "Decode a window again at a higher temperature when its text's zlib compression "
        "ratio exceeds this (repetition).")
    logprob_threshold: float = _f(
        -1.0, "Decode a window again at a higher temperature when its average token "
        "log-probability is below this.")
    no_speech_threshold: float = _f(
        0.6, "Skip a window as silence when its no-speech probability exceeds this and its "
        "average log-probability is below --logprob-threshold.")
    beam_size: int = _f(
        1, "Beams for windows decoded at temperature 0 when a request sends no 'beam_size' "
        "field (1: greedy, fastest; 5: openai-whisper's CLI, slower, sometimes more accurate); "
        "1..16.")
    best_of: int = _f(
        1, "Samples drawn for windows decoded at temperature > 0 (the fallback) when a "
        "request sends no 'best_of' field; the most likely one is kept; 1..16.")
    mel_padding: str = _f(
        "silence", "Layout of a window shorter than 30 s when a request sends no 'mel_padding' "
        "field: silence (the log-mel of the audio followed by silence; lower WER on our "
        "clips) or zeros (the audio's frames zero-filled to 30 s: openai-whisper's "
        "transcribe() and faster-whisper, the same tokens as theirs).", choices=MEL_PADDINGS)
    enable_debug_endpoints: bool = _f(
        False, "Serve GET /debug/integrity (runs the KV-cache integrity check; for tests). "
        "Needs the API key when one is set; rate-limited by --debug-rate-limit.")
    debug_rate_limit: float = _f(
        5.0, "Most /debug/* requests per second (more: 429 with Retry-After).")
    max_pending_audio_mb: float = _f(
        256.0, "Most MiB of uploaded audio held by requests still being decoded or waiting "
        "to be; a request that would exceed it waits (--pending-wait-seconds), then gets 503 "
        "with Retry-After.")
    pending_wait_seconds: float = _f(
        60.0, "Most seconds a received upload waits for room in --max-pending-audio-mb "
        "(while other uploads are decoded) before it is refused with 503; 0: refuse at once.")
    allowed_origins: str | None = _f(
        None, "Comma-separated browser origins allowed to call the API (CORS), e.g. "
        "'https://app.example.com'; '*' allows any. Default: none, a request with an Origin "
        "header is refused (403).")
    max_connections: int = _f(
        512, "Most open HTTP connections (also capped below the open-file limit); beyond it "
        "the oldest idle connection is closed, and requests beyond it get 503.")
    http: str = _f(
        "auto", "HTTP/1.1 parser: httptools (C), h11 (pure Python), or auto (httptools when "
        "installed, as it is with edserve's dependencies); the event loop is uvloop when "
        "installed. Measured on an H200 host at 32 clients: 5.0 vs 5.8 ms of API-process CPU "
        "per request, 96 vs 87 requests/s (benchmarks/RESULTS.md, wave 12).",
        choices=HTTP_IMPLS)
    timeout_keep_alive: float = _f(
        5.0, "Seconds an idle keep-alive connection stays open between requests.")
    header_timeout: float = _f(
        10.0, "Seconds a connection may take to send a complete request head (slow or silent "
        "connections are closed).")
    body_timeout: float = _f(
        30.0, "Most seconds between two chunks of a request body (slower uploads: 408).")
    audio_workers: int | None = _f(
        None, "Processes that decode uploads and compute their log-mels, off the API "
        "process's event loop and GIL (auto: half the usable cores, 1 to 8); 0: threads of "
        "the API process instead.", auto=True)
    device_features_above_s: float | None = _f(
        None, "Uploads longer than this many seconds get their log-mel computed on the "
        "engine's device (an engine-process thread on its own CUDA stream: milliseconds, "
        "against ~1 s of an audio worker's CPU per 10 minutes of audio), the audio workers "
        "only decoding them; negative: every log-mel on the audio workers. auto: 30 on a "
        "CUDA engine, off on the CPU.", auto=True)
    device_features_idle: int | None = _f(
        None, "While at most N transcription requests are in flight (this one included), every "
        "upload's log-mel is computed on the engine's device, whatever its length (a 16 kHz "
        "16-bit WAV is then read in the API process): lower latency on a lightly loaded "
        "server; under load short uploads go to the audio workers, which keeps the engine's "
        "device and process for its steps. Needs log-mels on the device "
        "(--device-features-above-s not negative). auto: 2 on a CUDA engine, 0 on the CPU; "
        "0: off.", auto=True)
    step_features: bool | None = _f(
        None, "Compute a short upload's log-mel inside the engine's prefill step: the upload "
        "is only decoded (a 16 kHz 16-bit WAV in the API process, else on an audio worker), "
        "a clip that fits one 30 s window travels to the engine as its samples, and each "
        "prefill step computes the log-mels of the clips it admits together on the engine's "
        "device (one batched STFT); longer uploads get theirs on the device "
        "(--device-features-above-s, 30 when unset). Default (unset): on for a CUDA engine "
        "(H200, 32 clients: 96.0-98.4 vs 81.7-84.4 requests/s; benchmarks/RESULTS.md, wave "
        "34), off on the CPU (the audio workers run beside the engine's cores there); "
        "--no-step-features: off.")
    data_parallel_size: int = _f(
        1, "Engine worker processes behind this server (data parallelism): on CUDA one per "
        "visible GPU (pinned with CUDA_VISIBLE_DEVICES), on CPU the cores split between them; "
        "each request goes to the least-loaded worker, a worker that dies fails its requests "
        "with 503 and is restarted. Whisper models only.")
    engine_process: bool | None = _f(
        None, "Run the engine in a worker process even with --data-parallel-size 1 (the API "
        "process in front of one engine process: the data-parallel path with N = 1; a dead "
        "engine process is restarted and fails only its in-flight requests), so the engine "
        "loop and the HTTP handlers do not share one GIL. Default (unset): on for a Whisper "
        "model on one CUDA GPU (H200, 32 clients: 93.7 vs 61.8 requests/s on a thread), else "
        "the engine runs on a thread of the API process. Whisper models only.")
    held_log_mel_mb: int = _f(
        4096, "MiB of long uploads' log-mels an engine worker process keeps on its device while "
        "their transcriptions run (computed there, --device-features-above-s; each window's "
        "request then refers to it instead of carrying 1.5 MB: a 10-minute file's log-mel is "
        "30 MB); a log-mel that does not fit is sent back to the API process as before; 0: "
        "none kept.")
    json_whitespace: bool = _f(
        True, "Allow whitespace between the tokens of grammar-constrained JSON (chat "
        "response_format and forced tool calls), as vLLM's default; --no-json-whitespace "
        "makes that JSON compact, which stops a weak or small model from padding it with "
        "spaces and newlines until max_tokens.")
    openapi_docs: bool = _f(
        True, "Serve the OpenAPI document at /openapi.json and its Swagger UI at /docs "
        "(no API key needed; the UI loads its scripts from a CDN); --no-openapi-docs turns "
        "both off.")
    drain_timeout: float = _f(
        30.0, "On SIGINT/SIGTERM, seconds to let in-flight requests finish before the engine "
        "(and any data-parallel worker) is stopped.")

    def __post_init__(self) -> None:
        check_mel_padding(self.mel_padding)
        if self.audio_workers is not None and self.audio_workers < 0:
            raise ValueError(f"--audio-workers must be auto or >= 0, got {self.audio_workers}")
        if self.held_log_mel_mb < 0:
            raise ValueError(f"--held-log-mel-mb must be >= 0, got {self.held_log_mel_mb}")
        if self.step_features and self.device_features_above_s is not None \
                and self.device_features_above_s < 0:
            raise ValueError("--step-features needs log-mels of longer uploads on the device: "
                             "drop the negative --device-features-above-s")
        if self.device_features_idle is not None and self.device_features_idle < 0:
            raise ValueError(f"--device-features-idle must be auto or >= 0, got "
                             f"{self.device_features_idle}")
        for name in ("beam_size", "best_of"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_GROUP_ROWS:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer from 1 to "
                                 f"{MAX_GROUP_ROWS}, got {n!r}")

    def device_features_threshold(self, device_type: str) -> float | None:
        """Seconds above which an upload's log-mel goes to the engine (None: never)."""
        above = self.device_features_above_s
        if above is None:
            return AUTO_DEVICE_FEATURES_S \
                if device_type == "cuda" or self.step_features_on(device_type) else None
        return None if above < 0 else above

    def step_features_on(self, device_type: str) -> bool:
        """Whether short uploads' log-mels are computed in the prefill step (unset: on for
        :data:`AUTO_STEP_FEATURES`, unless a negative --device-features-above-s keeps every
        log-mel on the audio workers)."""
        if self.step_features is None:
            host_only = self.device_features_above_s is not None \
                and self.device_features_above_s < 0
            return device_type in AUTO_STEP_FEATURES and not host_only
        return self.step_features

    def device_features_idle_max(self, device_type: str) -> int:
        """In-flight requests up to which every upload's log-mel goes to the engine."""
        if self.device_features_idle is None:
            return AUTO_DEVICE_FEATURES_IDLE if device_type == "cuda" else 0
        return self.device_features_idle

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    @property
    def max_pending_audio_bytes(self) -> int:
        return int(self.max_pending_audio_mb * 1024 * 1024)

    @property
    def origins(self) -> tuple[str, ...]:
        """``allowed_origins`` as a tuple (lower-case, no trailing slash)."""
        raw = self.allowed_origins or ""
        return tuple(o.strip().rstrip("/").lower() for o in raw.split(",") if o.strip())


def server_flags_error(args: Any) -> str | None:
    """Why parsed ``serve``/``serve-ray`` flags cannot run (None when they can): the server
    config's own checks, and a beam/best_of group of rows that must fit the engine's rows."""
    from edserve.config_args import config_from_args

    try:
        config_from_args(args, ServerConfig)
    except ValueError as exc:
        return str(exc)
    for name in ("beam_size", "best_of"):  # auto (None): the engine checks once sized
        limit = args.max_running_requests
        if limit is not None and (n := getattr(args, name)) > limit:
            return (f"--{name.replace('_', '-')} {n} needs --max-running-requests >= {n} "
                    f"(one KV row per beam or sample; got {args.max_running_requests})")
    return None
