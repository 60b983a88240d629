"""Arguments a launcher would pass for a 2-rank expert-parallel CPU run.

The model is SGLang's "dummy" path, which resolves without downloading weights.
"""

BASE_ARGS = ["--model-path", "dummy", "--device", "cpu", "--tp-size", "2", "--ep-size", "2"]
