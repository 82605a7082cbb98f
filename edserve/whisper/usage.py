"""Token counts of one transcription (the ``usage`` of OpenAI's streamed transcripts)."""

from __future__ import annotations

from dataclasses import dataclass

from edserve.engine.outputs import GenerateOutput
from edserve.engine.request import GenerateRequest
from edserve.whisper.window_segments import INPUT_STRIDE


@dataclass
class TokenUsage:
    """Summed over every engine request of a transcription (each window and each fallback
    attempt): ``text_tokens`` decoder prompt tokens, ``audio_tokens`` encoder positions the
    decoder attended to (1500 per 30 s window attempt), ``output_tokens`` tokens generated
    (the kept sequence of a beam or best-of group; stop token excluded)."""

    text_tokens: int = 0
    audio_tokens: int = 0
    output_tokens: int = 0

    def add(self, request: GenerateRequest, output: GenerateOutput) -> None:
        self.text_tokens += len(request.prompt_ids)
        self.audio_tokens += audio_tokens(request)
        self.output_tokens += len(output.token_ids)

    def openai(self) -> dict[str, object]:
        """OpenAI's token usage object (``type: "tokens"``)."""
        n_in = self.text_tokens + self.audio_tokens
        return {"type": "tokens", "input_tokens": n_in,
                "input_token_details": {"text_tokens": self.text_tokens,
                                        "audio_tokens": self.audio_tokens},
                "output_tokens": self.output_tokens, "total_tokens": n_in + self.output_tokens}


def audio_tokens(request: GenerateRequest) -> int:
    """Encoder positions ``request`` attends to: its log-mel's frames over the encoder's
    stride, or, without an encoder input, its held region's (``encoder_kv``: the engine reads
    the extent from the handle then, so a retry counts as its first attempt did)."""
    mel = request.encoder_input
    if mel is not None:
        return mel.shape[-1] // INPUT_STRIDE
    return request.encoder_kv.encoder_len if request.encoder_kv is not None else 0
