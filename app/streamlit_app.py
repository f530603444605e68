"""moeviz app entry point: `streamlit run app/streamlit_app.py`."""

import os

import streamlit as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the app never downloads (importing moeviz sets nothing)

st.set_page_config(page_title="moeviz", page_icon="🔬", layout="wide")

page = st.navigation(
    [
        st.Page("pages/routing.py", title="Routing", icon="🔀", default=True),
        st.Page("pages/load.py", title="Load & collapse", icon="⚖️"),
        st.Page("pages/structure.py", title="Structure", icon="🕸️"),
        st.Page("pages/attention.py", title="Attention", icon="👁️"),
        st.Page("pages/compare.py", title="Compare", icon="🆚"),
        st.Page("pages/about.py", title="About the model", icon="ℹ️"),
        st.Page("pages/why.py", title="Why this expert?", icon="❓"),
        st.Page("pages/checkpoints.py", title="Checkpoints", icon="📈"),
        st.Page("pages/corpus.py", title="Corpus", icon="🗄️"),
    ]
)
page.run()
