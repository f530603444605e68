"""The app's server: `streamlit run app/serve.py` (what `moeviz app` runs) serves the pages of
streamlit_app.py as Streamlit's ASGI app (`st.App`), and imports what every page imports on a thread
as the server starts (`preload`), while a browser is still loading Streamlit's own scripts."""

from __future__ import annotations

from contextlib import asynccontextmanager

import streamlit as st
from components import preload


@asynccontextmanager
async def lifespan(_app):
    preload.start()
    yield None


app = st.App("streamlit_app.py", lifespan=lifespan)
