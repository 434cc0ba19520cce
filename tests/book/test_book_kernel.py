"""The chapters' nbval kernel (``make test``: ``--nbval-kernel-name tpattn-portable``) runs with
torch's and MKL's portable code paths on one thread (the kernel spec's env)."""
import os

import pytest
from jupyter_client.kernelspec import NoSuchKernel
from jupyter_client.manager import start_new_kernel

PROBE = ("import os, torch; print(torch.backends.cpu.get_cpu_capability(), "
         "torch.get_num_threads(), os.environ.get('MKL_CBWR'))")


def test_the_chapters_kernel_has_portable_cpu_kernels():
    try:
        km, kc = start_new_kernel(kernel_name="tpattn-portable")
    except NoSuchKernel:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("no tpattn-portable kernel spec: make test writes it into .venv")
        pytest.skip("no tpattn-portable kernel spec (make test writes it)")
    seen = []
    try:
        kc.execute_interactive(PROBE, output_hook=lambda m: seen.append(
            m["content"].get("text", "")) if m["msg_type"] == "stream" else None, timeout=60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert "".join(seen).split() == ["DEFAULT", "1", "COMPATIBLE"], seen
