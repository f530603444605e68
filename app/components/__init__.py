"""The app's building blocks; pages only compose them. One module per concern:

- `access`: which models and stores may be opened (sources, allowed folders); no Streamlit.
- `capture_cache`: the shared, thread-safe cache of captures per (model, text); no Streamlit.
- `routing_frames`: the frames the Routing page slices, built once per trace; no Streamlit.
- `scale_frames`: per-layer and per-expert frames for models of over 20 experts; no Streamlit.
- `errors`: library errors shown as a message that stops the page.
- `caches`: the server-wide caches (models, captures, traces, frames) and loading with progress.
- `widgets`: widgets whose value survives page switches (kept, toggle, number).
- `pickers`: model, layer, expert, token and head pickers.
- `expert_axis`: the expert axis at scale: sort, top-N filter, searchable expert picker.
- `prompt`: the prompt form, prompt files, and the prompt-or-corpus choice.
- `exports`: charts with their downloads, table downloads, routing-table files.
- `corpus_store`, `checkpoint_store`: the stores the Corpus and Checkpoints pages build and query.
- `deployment`: the Deployment page's routes and cached what-if results.
- `learn`, `lab`: the Learn lesson's captures; the Lab's training runs per session.

This package imports nothing itself, so the Streamlit-free modules can be used (and tested) without it.
"""
