"""pytest setup: force CPU JAX for every test."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles far more than it computes (small shapes, each program run a few times): XLA's
# CPU backend without LLVM's optimisation passes compiles ~30% faster (a compile-bound test command,
# 18.2 -> 12.9 s). XLA's HLO passes are unchanged; the machine code runs slower and may round in
# another order than an optimised build's, so the suite compares programs built alike in one run or
# within tolerances. The commands the tests start inherit it. KVJAX_TEST_XLA_OPT=on: XLA's defaults.
if os.environ.get("KVJAX_TEST_XLA_OPT", "off") != "on" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                             " --xla_llvm_disable_expensive_passes=true").strip()
# XLA's CPU backend hands some dots to YNNPACK ("ynn" library fusions) on CPUs with bfloat16
# instructions (seen 2026-12-07, jax 0.10.2, a Sapphire Rapids Xeon: a [4, K] bfloat16 dot became a
# YNN fusion while a [1, K] one stayed XLA's float32 dot, and the rows of one differ from the other's
# in the last bits). The suite checks that a verify forward's rows are one-row forwards' bits and
# that a cache's bytes do not depend on how many rows a forward ran; with the fusion those hold on
# some CPUs and not on others. An empty list turns the fusion off, so every CPU runs XLA's own dots
# (the GPU suite, KVJAX_TEST_GPU=1, leaves its flags as they are).
if os.environ.get("KVJAX_TEST_GPU", "0") != "1" and "ynn_fusion_type" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type=").strip()
# One persistent compilation cache for the run, shared by the xdist workers and the commands the
# tests start (they inherit the variable), in a fresh folder: every run compiles each program it
# checks once, and a module or process that needs it again (jax's in-memory caches are dropped after
# every module, below) loads it. Out of the user's cache folder. KVJAX_TEST_COMPILE_CACHE=off: none.
_RUN_CACHE = os.path.join(tempfile.gettempdir(), f"kvjax-tests-jax-{os.getpid()}")   # the controller's pid
if os.environ.get("KVJAX_TEST_COMPILE_CACHE", "on") == "off":
  os.environ.setdefault("KVJAX_COMPILE_CACHE_DIR", "off")
else:
  os.environ.setdefault("KVJAX_COMPILE_CACHE_DIR", _RUN_CACHE)   # workers inherit the controller's

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import gc  # noqa: E402

import pytest  # noqa: E402

from kvjax import compile_cache, executables  # noqa: E402

compile_cache.enable()   # KVJAX_COMPILE_CACHE_DIR: the run's folder, or off


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drop jax's compiled programs and traces after each test module. The interpreted kernels
  (Mosaic GPU, Triton) compile large programs; kept for the whole pytest run they added up until
  XLA crashed compiling a later test (a segfault in test_streaming on the 2-core CI machine,
  2026-12-01). Later modules compile their own anyway."""
  yield
  jax.clear_caches()
  executables.clear_loaded()    # the stored steps this worker loaded or compiled, likewise
  gc.collect()
  compile_cache.enable()   # a module that turned the cache off (load_model(compile_cache=False)) is over


def pytest_sessionfinish(session):
  """The controller (or a run without workers) removes the run's cache folder."""
  if not hasattr(session.config, "workerinput") and os.environ.get("KVJAX_COMPILE_CACHE_DIR") == _RUN_CACHE:
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)


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
