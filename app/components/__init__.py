"""The app's building blocks; pages only compose them. Streamlit glue and caching only: every number comes
from `moeviz`. One module per concern:

- `access`: which models and stores may be opened (sources, allowed folders); no Streamlit.
- `load_options`: how a model loads (dtype, device, device map) and the model key that names it; no Streamlit.
- `trace_cache`: the shared, thread-safe results of the server: captured traces per (model, text); no
  Streamlit.
- `routing_frames`: the frames the Routing page slices, built once per trace (per layer over 20 experts); no
  Streamlit.
- `preload`: what every page imports, imported before the server answers (app/serve.py); no Streamlit.
- `warmup`: the server's one import of torch and transformers, in the background; no Streamlit.
- `scale`: when the app switches to its views at scale (over 20 experts); no Streamlit.
- `docs`: the sections of the project's docs the app shows; no Streamlit.
- `errors`: library errors shown as a message that stops the page.
- `caches`: the server-wide caches (models, traces, frames) and loading with progress.
- `widgets`: widgets whose value survives page switches (kept, toggle, number).
- `pickers`: model, layer, token and head pickers.
- `expert_axis`: the expert axis of every per-expert view (sort, top-N filter and the expert picker at
  scale) and the views it chooses between.
- `prompt`: the prompt form and prompt files.
- `routing_files`: routing files (a trace or a load table) typed as a path or uploaded, read and cached.
- `page_input`: a page's input, shared by the pages: the model on the prompt (or corpus) or a routing
  file, and what a file lacks (scores, ranked slots, tokens) said once.
- `exports`: charts with their downloads, table downloads, routing-table files.
- `corpus_store`, `checkpoint_store`: the stores the Corpus and Checkpoints pages build and query.
- `deployment`: the Deployment page's routes and cached what-if results.
- `learn`, `lab`: the Learn lesson's captures; the Lab's training runs per session.

This package imports nothing itself, so the Streamlit-free modules can be used (and tested) without it;
app/import-contracts.toml checks that they stay Streamlit-free and that pages → components → moeviz.
"""
