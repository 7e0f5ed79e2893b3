"""The web app (Gradio), split around one explicit ``AppState``: state (models and the engine thread),
plan (checking and clamping requests), views (columns, plots, tables), handlers (the Race, Benchmark
and API entry points) and layout (the page). ``app.py`` only parses arguments and wires these up."""
