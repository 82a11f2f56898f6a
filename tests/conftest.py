"""pytest setup: force CPU JAX for every test."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
