"""The app's pages: scripts that `st.navigation` in streamlit_app.py runs, composing `components` (a package
only so that app/import-contracts.toml can check what they import)."""
