"""What another user on the worker's host can do, over real worker processes (docs/security.md, "Local users"):
plant a library where the worker looks for its compiled kernels, or listen on a loopback port a request names."""
from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from decode_worker_kernels import cpu_native

from tests.servers import start_worker
from tests.tiny_model import save_tiny_chat_model

NOBODY = 65534
PLANTED = r'''
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen("%s", "w"); if (f) fclose(f); }
int native_abi(void) { return %d; }
'''


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("cc") is None, reason="needs root (to make a folder another "
                    "user owns) and a C compiler")
def test_a_kernel_folder_another_user_made_is_not_loaded_from(tmp_path):
    """Another user made the worker's kernel folder first, writable by all, and put a library under the very name
    the worker would build: the worker builds its own in a private folder and the planted constructor never runs."""
    cache, ran = tmp_path / "cache", tmp_path / "planted-constructor-ran"
    kernels = cache / "kernels"
    kernels.mkdir(parents=True)
    target = cpu_native.library_path(kernels)
    source = tmp_path / "planted.c"
    source.write_text(PLANTED % (ran, cpu_native.ABI))
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(target)], check=True)
    for path in (kernels, target):
        os.chown(path, NOBODY, NOBODY)
    kernels.chmod(0o777)
    model = save_tiny_chat_model(tmp_path / "model")
    (tmp_path / "logs").mkdir()
    worker = start_worker("kernel-cache", tmp_path / "logs", "colocated", "--model-path", str(model),
                          env={"DECODE_WORKER_CACHE": str(cache)})
    try:
        r = httpx.post(worker.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}},
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        worker.stop()
    assert not ran.exists(), "the planted library's constructor ran inside the worker"
    assert "native CPU kernels unavailable" not in worker.log.read_text()  # it built its own, privately
