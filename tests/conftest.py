"""pytest setup: force CPU JAX for every test."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# no persistent compilation cache unless a test asks for one (tests/test_warmup.py): the suite's
# programs stay out of the user's cache folder, and every run compiles what it checks
os.environ.setdefault("KVJAX_COMPILE_CACHE_DIR", "off")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drop jax's compiled programs and traces after each test module. The interpreted kernels
  (Mosaic GPU, Triton) compile large programs; kept for the whole pytest run they added up until
  XLA crashed compiling a later test (a segfault in test_streaming on the 2-core CI machine,
  2026-12-01). Later modules compile their own anyway."""
  yield
  jax.clear_caches()
  gc.collect()


ON_GPU = os.environ.get("KVJAX_TEST_GPU", "0") == "1"


def pytest_collection_modifyitems(config, items):
  """The compiled GPU tests (named test_gpu_*) exist everywhere and are reported as skipped
  without KVJAX_TEST_GPU=1, so a CPU run shows what it did not check."""
  del config
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="compiled GPU kernels: run with KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu on an "
                                 "NVIDIA GPU")
  for item in items:
    if item.name.startswith("test_gpu_"):
      item.add_marker(skip)
