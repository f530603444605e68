"""What the Lab page's app tests share: the page opened through the app, a run without errors, a chart's
dataset."""

from __future__ import annotations

import pandas as pd
from streamlit.testing.v1 import AppTest

from tests.support.app import APP


def checked(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert not errors, errors
    return at


def chart_frame(at: AppTest, title: str) -> pd.DataFrame:
    """The dataset of the one chart titled `title` (Streamlit ships it as Arrow)."""
    import pyarrow as pa

    charts = [c for c in at.get("vega_lite_chart") if f'"text": "{title}"' in c.proto.spec]
    assert len(charts) == 1, f"{len(charts)} charts titled {title!r}"
    (dataset,) = charts[0].proto.datasets
    return pa.ipc.open_stream(dataset.data.data).read_all().to_pandas()


def lab_page(timeout_s: float) -> AppTest:
    """The Lab page, run once through the app's entry script, checked for errors."""
    at = AppTest.from_file(str(APP), default_timeout=timeout_s)
    at.switch_page("pages/lab.py")
    return checked(at.run())
