"""Host-to-device copy paths in JAX: which one reaches PCIe speed.

  python -m experiments.bench_h2d --sizes_mib=13,64,1024      # from the repository root

Variants per size: pageable numpy `device_put`; pinned_host array `device_put`
to its sharding `.with_memory_kind("device")`; a jitted identity whose
`out_shardings` is the device memory kind; and the same jitted transfer issued
8 at a time before one `block_until_ready` (queue depth).
"""

import logging

from absl import app, flags


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  flags.DEFINE_list("sizes_mib", ["13", "64", "1024"], "copy sizes (MiB)")
  flags.DEFINE_integer("reps", 5, "timed repetitions")


FLAGS = flags.FLAGS


def main(argv):
  del argv
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)   # its backend probe: "Unable to initialize backend 'tpu'"
  import jax
  import numpy as np
  from experiments.lib import timing
  from kvjax.streaming.host_history import pinned_available
  dev = jax.devices()[0]
  print("device", dev, "pinned available:", pinned_available(),
        [m.kind for m in dev.addressable_memories()], flush=True)
  pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  ident = jax.jit(lambda x: x, out_shardings=on_dev)
  print(f"{'MiB':>6} {'variant':>22} {'ms':>8} {'GB/s':>7}")
  for mib in [int(s) for s in FLAGS.sizes_mib]:
    host = np.random.default_rng(0).integers(0, 255, (mib, 2**20), dtype=np.uint8)
    pin = jax.device_put(host, pinned)
    pin.block_until_ready()
    variants = {
        "numpy device_put": lambda: jax.device_put(host, dev),
        "pinned device_put": lambda: jax.device_put(pin, pin.sharding.with_memory_kind("device")),
        "pinned jit transfer": lambda: ident(pin),
        "pinned device_put x8": lambda: [jax.device_put(pin, on_dev) for _ in range(8)],
        "pinned jit x8": lambda: [ident(pin) for _ in range(8)],
    }
    for name, fn in variants.items():
      ms = timing.median_ms(fn, FLAGS.reps)
      nbytes = mib * 2**20 * (8 if "x8" in name else 1)
      print(f"{mib:>6} {name:>22} {ms:>8.2f} {nbytes / ms / 1e6:>7.1f}", flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
