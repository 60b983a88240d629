"""Serving benchmark across expert-parallel all-to-all backends.

For each backend in a list it starts the engine's real OpenAI-compatible server (vLLM or SGLang) with the
user's model and parallel settings, waits until it is healthy, runs the engine's own serving benchmark
client on one seeded request set, stops the server and goes on; then it writes one JSON per run, prints a
table with each backend's ratio to the first one and saves a plot. Run it as ``python -m bench_serving``
from a checkout, or ``uccl-ep bench-serving`` where the package is installed (it is installed as
``uccl_ep_plugin.bench_serving``). ``--help`` lists the settings.
"""
