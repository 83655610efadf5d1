"""The interop suite runs SGLang's own code, installed only in the interop venv (``make test-interop``, which sets
DECODE_WORKER_INTEROP=1): elsewhere its tests are not collected."""
import importlib.util
import os

if os.environ.get("DECODE_WORKER_INTEROP") != "1" and importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
