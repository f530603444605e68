"""moeviz app entry point: `streamlit run app/streamlit_app.py`."""

import importlib
import os
import sys

import streamlit as st
from components import presentation

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the app never downloads (importing moeviz sets nothing)

# Material icons: they come with Streamlit (emoji need an emoji font, which servers and kiosks often lack)
st.set_page_config(page_title="moeviz", page_icon=":material/biotech:", layout="wide")

page = st.navigation(
    {
        "Explore": [
            st.Page("pages/routing.py", title="Routing", icon=":material/alt_route:", default=True),
            st.Page("pages/load.py", title="Load & collapse", icon=":material/balance:"),
            st.Page("pages/structure.py", title="Structure", icon=":material/hub:"),
            st.Page("pages/attention.py", title="Attention", icon=":material/visibility:"),
            st.Page("pages/compare.py", title="Compare", icon=":material/compare_arrows:"),
            st.Page("pages/engines.py", title="Engines", icon=":material/compare:"),
            st.Page("pages/about.py", title="About the model", icon=":material/info:"),
            st.Page("pages/why.py", title="Why this expert?", icon=":material/help:"),
            st.Page("pages/checkpoints.py", title="Checkpoints", icon=":material/timeline:"),
            st.Page("pages/corpus.py", title="Corpus", icon=":material/database:"),
        ],
        "Teach": [
            st.Page("pages/learn.py", title="Learn", icon=":material/school:"),
            st.Page("pages/playground.py", title="Routing playground", icon=":material/tune:"),
            st.Page("pages/lab.py", title="Lab", icon=":material/science:"),
        ],
        "Deploy": [st.Page("pages/deployment.py", title="Deployment", icon=":material/dns:")],
    },
    expanded=True,  # every page in view (Streamlit folds a menu of over 12 pages behind "View N more")
)
# A chart wider than its column (a fixed-width overview + detail of hundreds of experts, on a 900 px screen)
# scrolls sideways inside the column instead of spilling over the page's edge.
st.html("<style>.stVegaLiteChart, [data-testid='stVegaLiteChart'] { overflow-x: auto; }</style>")
presentation.setup()  # the sidebar's "Projector layout" and "Large font" toggles, and their CSS
# transformers is fully imported before any page runs. Streamlit's fast reruns start a new script thread
# (another page, after a click) while the old one still runs, and `transformers` swaps itself for a lazy
# module in sys.modules during its first import: a page doing `from transformers import X` then is handed
# the half-built module and fails ("cannot import name X"). importlib waits for the import and returns the
# finished module (the first session's first run pays the import, which its page needs anyway).
# Every page also imports torch, pandas and Altair before drawing anything: on the server's first run these
# imports take seconds, so the page's name and a spinner are drawn first instead of a blank page.
LIBRARIES_EVERY_PAGE_IMPORTS = ("transformers", "torch", "pandas", "altair")
if any(library not in sys.modules for library in LIBRARIES_EVERY_PAGE_IMPORTS):
    starting = st.empty()
    with starting.container():
        st.title(page.title)
        with st.spinner("Starting moeviz: loading torch and transformers (once per server)…", show_time=True):
            for library in LIBRARIES_EVERY_PAGE_IMPORTS:
                importlib.import_module(library)
    starting.empty()
page.run()
