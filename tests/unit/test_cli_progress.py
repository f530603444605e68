"""Off a terminal the CLI writes one line per stage, not a redrawn bar (hundreds of frames in a CI log)."""

from __future__ import annotations

import io

from moeviz.cli.progress import StageLines, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_one_line_per_stage():
    out = io.StringIO()
    with progress_bar(total=3, desc="moeviz capture", unit="step", file=out) as bar:
        assert isinstance(bar, StageLines)
        bar.set_postfix_str("loading model")
        for mib in range(800):  # a load reports its bytes hundreds of times
            bar.set_postfix_str(f"loading model {mib / 10:,.1f}/80.0 MiB")
        bar.update()
        bar.set_postfix_str("generating 200 tokens")
        bar.update()
        bar.set_postfix_str("writing parquet")
        bar.update()
    assert out.getvalue().splitlines() == [
        "moeviz capture: loading model",
        "moeviz capture: loading model 0.0/80.0 MiB",  # the stage, once, not its 800 updates
        "moeviz capture: generating 200 tokens",
        "moeviz capture: writing parquet",
    ]


def test_a_bar_without_stages_says_what_it_did_once():
    out = io.StringIO()
    with progress_bar(total=40, desc="routing corpus", unit="seq", file=out) as bar:
        for _ in range(40):
            bar.update(1)
    assert out.getvalue() == "routing corpus: 40/40 seq\n"


def test_a_terminal_gets_the_bar():
    from tqdm import tqdm

    with progress_bar(total=2, desc="moeviz import", unit="step", file=_Terminal()) as bar:
        assert isinstance(bar, tqdm)
