"""What the tests share besides fixtures (those are in tests/conftest.py and a folder's own conftest.py).

engines: an engine's observable state, bad-call checks, decode and interrupt helpers, threads started together.
notebook_session: the magics' session and shell helpers.
json_schemas: the JSON schemas the constraint tests decode under.
random_trees: random branch trees for the attention tests.
chat_checkpoints: tiny checkpoints carrying published chat templates (chat_templates/).
lab_session: JupyterLab and headless Chromium for the browser test.
small_gpu_run, gpu_compile: scripts the GPU tests run in a fresh process (each says how to run it by hand).
"""
