"""What the Lab page's app tests share: a run without errors, a chart's dataset."""

from __future__ import annotations

import pandas as pd
from streamlit.testing.v1 import AppTest


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
