"""moeviz app's pages and navigation: what app/serve.py serves (`moeviz app`); `streamlit run
app/streamlit_app.py` runs it alone."""

import os

import altair as alt
import streamlit as st
from components import presentation, warmup

# Altair checks every chart object against the Vega-Lite schema as it is made (a whole serialisation and
# JSON-schema pass each: a third of a layer switch's server time on the sample); the chart functions' specs
# are validated by the chart tests, and the page's `to_dict` skips the check too (`exports.for_the_page`).
alt.utils.schemapi.disable_debug_mode()

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the app never downloads (importing moeviz sets nothing)

# Material icons: they come with Streamlit (emoji need an emoji font, which servers and kiosks often lack)
st.set_page_config(page_title="moeviz", page_icon=":material/biotech:", layout="wide")

routing = st.Page("pages/routing.py", title="Routing", icon=":material/alt_route:", default=True)
page = st.navigation(
    {
        "Explore": [
            routing,
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
# torch and transformers are imported once per server, on a thread of their own (`warmup`: a page that
# imported transformers while another script thread did could be handed its half-built module). The first
# page runs before that import, which would take most of its time: Routing draws the example prompt's
# routing from disk (`moeviz.trace.kept`) and waits for the import only where it needs the model
# (`caches.get_model`); every other page waits here, with its name and a spinner drawn meanwhile. The
# import starts once the first page has run, so that it does not slow that page down.
if not warmup.done() and page is not routing:
    starting = st.empty()
    with starting.container():
        st.title(page.title)
        with st.spinner("Starting moeviz: loading torch and transformers (once per server)…", show_time=True):
            warmup.wait()
    starting.empty()
try:
    page.run()
finally:
    warmup.start(background=True)
