"""moeviz app entry point: `streamlit run app/streamlit_app.py`."""

import streamlit as st

st.set_page_config(page_title="moeviz", page_icon="🔬", layout="wide")

page = st.navigation([st.Page("pages/routing.py", title="Routing", icon="🔀", default=True)])
page.run()
