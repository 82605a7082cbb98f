"""``edserve transcribe --beam-size/--best-of/--patience/--length-penalty``: openai-whisper's
defaults, argparse errors (exit 2) for bad values, and a beam search run on jfk.wav."""

from __future__ import annotations

import pytest
from whisper_fixtures import DATA, TINY_EN_TEXT

from edserve.batch_cli import _options, decoding_kwargs, group_rows
from edserve.cli import build_parser, main

JFK = str(DATA / "jfk.wav")


def _args(*extra: str):
    return build_parser().parse_args(["transcribe", JFK, *extra])


def test_defaults_are_openai_whispers():
    args = _args()
    assert decoding_kwargs(args) == dict(beam_size=5, best_of=5, patience=None,
                                         length_penalty=None, mel_padding="silence")


def test_flags_reach_transcribe_options():
    args = _args("--beam-size", "3", "--best-of", "2", "--patience", "1.5",
                 "--length-penalty", "0.6", "--mel-padding", "zeros")
    assert decoding_kwargs(args) == dict(beam_size=3, best_of=2, patience=1.5,
                                         length_penalty=0.6, mel_padding="zeros")
    opts = _options(args, seed=0)  # the batch path (folders, manifests, DP) builds these
    assert (opts.beam_size, opts.best_of, opts.patience, opts.length_penalty,
            opts.mel_padding) == (3, 2, 1.5, 0.6, "zeros")
    assert _options(_args("--beam-size", "1"), seed=0).beam_size == 1
    assert group_rows(args) == 3 and group_rows(_args("--beam-size", "1", "--best-of", "1")) == 1


@pytest.mark.parametrize("flags,needle", [
    (["--beam-size", "0"], "--beam-size"), (["--beam-size", "17"], "--beam-size"),
    (["--beam-size", "abc"], "--beam-size"), (["--beam-size", "2.5"], "--beam-size"),
    (["--best-of", "0"], "--best-of"), (["--best-of", "x"], "--best-of"),
    (["--patience", "0"], "--patience"), (["--patience", "nan"], "--patience"),
    (["--length-penalty", "-1"], "--length-penalty"),
    (["--length-penalty", "inf"], "--length-penalty"),
    (["--beam-size", "1", "--patience", "2"], "--patience"),
])
def test_bad_values_exit_2(flags, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["transcribe", JFK, *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument " + needle in err and "Traceback" not in err


def test_beam_size_5_prints_jfk(capsys):
    """A single file: the engine gets the 5 rows of one beam group, also when
    --max-running-requests asks for fewer."""
    with pytest.raises(SystemExit) as exit_info:
        main(["transcribe", JFK, "--beam-size", "5", "--max-running-requests", "2"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == TINY_EN_TEXT
