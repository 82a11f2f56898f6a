"""Tests for kvjax.streaming.arena: transactional layouts, views, leases, fences, phases."""

import jax
import jax.numpy as jnp
import pytest

from kvjax.streaming import arena as A
from kvjax.streaming.arena import (Arena, ArenaInvalidError, CapacityError, ManualFence, PhaseConsumer,
                                   PhaseCoordinator, RegionBusyError, RegionSpec, StaleLeaseError,
                                   StaleViewError, TransitionError)


def committed(arena, spec):
  txn = arena.begin()
  for name, (n, p) in spec.items():
    txn.reserve(name, n, persistent=p)
  return txn.commit()


def snapshot(arena):
  return arena.generation, dict(arena.regions), arena.valid


PREFILL = {"weights_cache": RegionSpec(1000, True), "workspace": RegionSpec(6000),
           "kv_pool": RegionSpec(2000)}
DECODE = {"weights_cache": RegionSpec(1000, True), "workspace": RegionSpec(1000),
          "kv_pool": RegionSpec(7000)}


# ---- transactions ------------------------------------------------------------

def test_reserve_past_capacity_refused_and_layout_untouched():
  a = Arena(10_000, alignment=256)
  committed(a, {"x": (3000, False)})
  before = snapshot(a)
  txn = a.begin()
  txn.reserve("a", 4000)
  with pytest.raises(CapacityError) as e:
    txn.reserve("b", 7000)
  # 4000 -> 4096 aligned; 10000 - 4096 = 5904 available, 7168 needed
  assert (e.value.needed, e.value.available) == (7168, 5904)
  assert "7168 B" in str(e.value) and "5904 B" in str(e.value) and "1264 B missing" in str(e.value)
  assert txn.reserved_bytes() == 4096          # the failed reserve added nothing
  assert snapshot(a) == before                  # nothing committed
  txn.reserve("b", 5904 - 256)
  plan = txn.commit()
  assert a.generation == before[0] + 1 and set(a.regions) == {"a", "b"}
  assert plan.changed == ("x",)
  assert [r.offset % 256 for r in a.regions.values()] == [0, 0]


def test_transaction_rules():
  a = Arena(4096)
  txn = a.begin()
  with pytest.raises(A.ArenaError, match="already open"):
    a.begin()
  with pytest.raises(ValueError, match="nbytes"):
    txn.reserve("z", 0)
  txn.reserve("z", 10)
  with pytest.raises(ValueError, match="twice"):
    txn.reserve("z", 10)
  txn.abort()
  assert a.regions == {} and a.generation == 0
  a.begin().abort()  # a new transaction may begin after abort


def test_views_bounds_and_staleness():
  a = Arena(8192)
  committed(a, {"keep": (512, True), "scratch": (1000, False)})
  k, s = a.view("keep"), a.view("scratch")
  sub = s.slice(100, 900)
  assert (sub.offset, sub.size) == (s.offset + 100, 900)
  with pytest.raises(ValueError, match="outside view"):
    s.slice(100, 901)
  with pytest.raises(ValueError, match="outside view"):
    sub.slice(-1, 1)
  with pytest.raises(KeyError):
    a.view("nope")
  committed(a, {"keep": (512, True), "scratch": (1000, False)})
  assert a.view("keep").offset == k.offset and k.check() is k    # survivor stays valid
  with pytest.raises(StaleViewError, match="stale"):
    s.check()
  with pytest.raises(StaleViewError):
    sub.slice(0, 1)
  # a persistent region whose size changes is re-placed: its old view goes stale
  committed(a, {"keep": (1024, True)})
  with pytest.raises(StaleViewError):
    k.check()


def test_commit_refuses_region_held_by_lease_in_flight():
  a = Arena(8192)
  committed(a, {"ring": (2048, False), "ws": (1024, False)})
  lease = a.acquire("ring", owner="attention")
  fence = ManualFence("attn step 7")
  lease.add_fence(fence)
  before = snapshot(a)
  txn = a.begin()
  txn.reserve("ring", 4096)
  with pytest.raises(RegionBusyError, match="unsignalled"):
    txn.commit()
  assert snapshot(a) == before and not lease.released
  assert lease.view().offset == before[1]["ring"].offset
  with pytest.raises(RegionBusyError, match="unsignalled"):
    lease.release()
  fence.signal()
  lease.release()
  with pytest.raises(StaleLeaseError, match="released"):
    lease.view()
  txn.commit()
  assert a.regions["ring"].size == 4096


def test_lease_release_waits_when_asked():
  a = Arena(4096)
  committed(a, {"r": (256, False)})
  lease = a.acquire("r")
  f = ManualFence()
  lease.add_fence(f)
  with pytest.raises(RegionBusyError):
    lease.release(wait=True, timeout=0.0)
  f.signal()
  lease.release(wait=True, timeout=0.0)
  assert lease.released and a.leases() == []


def test_fragmentation_reported_by_commit():
  a = Arena(4096, alignment=256)
  committed(a, {"lo": (1024, False), "mid": (1024, True), "hi": (1024, False)})
  # "mid" survives at [1024, 2048); 2560 B fits in total but not contiguously.
  before = snapshot(a)
  txn = a.begin()
  txn.reserve("mid", 1024, persistent=True)
  txn.reserve("big", 2560)
  with pytest.raises(CapacityError, match="contiguous") as e:
    txn.commit()
  assert (e.value.needed, e.value.available) == (2560, 2048)
  assert snapshot(a) == before


# ---- phase coordinator --------------------------------------------------------

class Recorder(PhaseConsumer):
  """A consumer holding a lease on every region, with an executable per region."""

  def __init__(self, arena, log, name="kv"):
    self.name = name
    self.arena = arena
    self.log = log
    self.leases = {}
    self.views = {}
    self.executables = {}
    self.inflight = []
    self.active = True
    self.bind()

  def bind(self):
    for n in self.arena.regions:
      if n not in self.leases or self.leases[n].released:
        self.leases[n] = self.arena.acquire(n, owner=self.name)
      if n not in self.views:
        self.views[n] = self.leases[n].view()
        self.executables[n] = ("exe", n, self.arena.regions[n].generation)

  def prepare(self, plan):
    self.log.append("prepare")

  def stop(self):
    self.log.append("stop")
    self.active = False

  def fences(self):
    self.log.append("drain")
    return list(self.inflight)

  def invalidate(self, plan):
    self.log.append("invalidate")
    for n in plan.changed:
      self.executables.pop(n, None)
      self.views.pop(n, None)

  def release(self, plan):
    self.log.append("release")
    for n in plan.changed:
      self.leases[n].release()

  def rebind(self, arena, plan):
    self.log.append("rebind")
    self.bind()

  def activate(self):
    self.log.append("activate")
    self.active = True


def test_transition_runs_steps_in_order_and_keeps_persistent():
  a = Arena(10_240)
  PhaseCoordinator(a).transition(PREFILL)
  log = []
  c = Recorder(a, log)
  co = PhaseCoordinator(a)
  co.register(c)
  keep_lease, keep_view = c.leases["weights_cache"], c.views["weights_cache"]
  kv_lease, kv_view = c.leases["kv_pool"], c.views["kv_pool"]
  gen = a.generation
  plan = co.transition(DECODE)
  assert log == ["prepare", "stop", "drain", "invalidate", "release", "rebind", "activate"]
  assert co.history == list(A.STEPS)
  assert plan.survivors == ("weights_cache",) and set(plan.changed) == {"workspace", "kv_pool"}
  assert a.generation == gen + 1 and c.active
  assert keep_view.check() is keep_view and not keep_lease.released          # untouched
  assert a.regions["weights_cache"].offset == keep_view.offset
  with pytest.raises(StaleViewError):
    kv_view.check()
  with pytest.raises(StaleLeaseError):
    kv_lease.view()
  with pytest.raises(StaleLeaseError):
    kv_lease.add_fence(ManualFence())
  assert c.views["kv_pool"].size == 7000 and c.leases["kv_pool"].generation == a.generation


def test_transition_drops_leftover_leases_after_drain():
  a = Arena(10_240)
  PhaseCoordinator(a).transition(PREFILL)
  stray = a.acquire("kv_pool", owner="forgotten")
  f = ManualFence()
  stray.add_fence(f)
  f.signal()
  PhaseCoordinator(a).transition(DECODE)
  with pytest.raises(StaleLeaseError, match="changed by the commit"):
    stray.check()


def test_region_in_flight_blocks_transition():
  a = Arena(10_240)
  PhaseCoordinator(a).transition(PREFILL)
  log = []
  c = Recorder(a, log)
  fence = ManualFence("queued attention")
  c.leases["kv_pool"].add_fence(fence)
  co = PhaseCoordinator(a, drain_timeout_s=0.0)
  co.register(c)
  before = snapshot(a)
  with pytest.raises(TransitionError) as e:
    co.transition(DECODE)
  assert e.value.step == "drain"
  assert snapshot(a) == before and c.active and a.accepting
  assert log[-1] == "activate"                     # restarted on the old layout
  assert c.views["kv_pool"].check() and not c.leases["kv_pool"].released
  fence.signal()
  co.transition(DECODE)
  assert a.regions["kv_pool"].size == 7000


def test_consumer_fence_drained():
  a = Arena(10_240)
  PhaseCoordinator(a).transition(PREFILL)
  c = Recorder(a, [])
  f = ManualFence("graph")
  c.inflight.append(f)
  co = PhaseCoordinator(a, drain_timeout_s=0.0)
  co.register(c)
  with pytest.raises(TransitionError, match="drain"):
    co.transition(DECODE)
  f.signal()
  co.transition(DECODE)


def test_stop_blocks_new_leases_during_transition():
  a = Arena(10_240)
  PhaseCoordinator(a).transition(PREFILL)
  seen = []

  class Late(PhaseConsumer):
    def invalidate(self, plan):
      with pytest.raises(RegionBusyError, match="transitioning"):
        a.acquire("kv_pool")
      seen.append(True)

  co = PhaseCoordinator(a)
  co.register(Late())
  co.transition(DECODE)
  assert seen == [True] and a.acquire("kv_pool")


@pytest.mark.parametrize("fail_step", A.STEPS)
def test_injected_failure_never_half_applied(fail_step):
  a = Arena(10_240)
  PhaseCoordinator(a).transition(PREFILL)
  log = []
  c = Recorder(a, log)

  def fault(step):
    if step == fail_step:
      raise RuntimeError(f"injected at {step}")

  co = PhaseCoordinator(a, fault=fault)
  co.register(c)
  before = snapshot(a)
  old_kv_view = a.view("kv_pool")
  with pytest.raises(TransitionError) as e:
    co.transition(DECODE)
  assert e.value.step == fail_step
  if A.STEPS.index(fail_step) < A.STEPS.index("rebind"):
    # previous committed state valid: same layout, views usable, work resumed
    assert snapshot(a) == before
    assert old_kv_view.check() is old_kv_view
    assert c.views["kv_pool"].check() and not c.leases["kv_pool"].released
    assert a.accepting and c.active
    assert set(c.executables) == set(a.regions)
  else:
    # committed, then failed: explicitly invalid, nothing usable
    assert not a.valid and a.generation == before[0] + 1
    with pytest.raises(ArenaInvalidError):
      a.view("kv_pool")
    with pytest.raises((ArenaInvalidError, StaleViewError)):
      old_kv_view.check()
    with pytest.raises(StaleLeaseError):
      c.leases["weights_cache"].check()
  # A later transition recovers a valid arena either way.
  co.fault = None
  co.transition(DECODE)
  assert a.valid and a.view("kv_pool").size == 7000


def test_commit_failure_keeps_leases():
  a = Arena(10_240)
  PhaseCoordinator(a).transition(PREFILL)
  c = Recorder(a, [])
  stray = a.acquire("kv_pool", owner="stray")      # not released by any consumer
  co = PhaseCoordinator(a, fault=lambda s: (_ for _ in ()).throw(OSError("x")) if s == "commit" else None)
  co.register(c)
  before = snapshot(a)
  with pytest.raises(TransitionError, match="commit"):
    co.transition(DECODE)
  assert snapshot(a) == before and not stray.released and stray.view().size == 2000


def test_capacity_error_before_any_step():
  a = Arena(10_240)
  PhaseCoordinator(a).transition(PREFILL)
  log = []
  co = PhaseCoordinator(a)
  co.register(Recorder(a, log))
  before = snapshot(a)
  with pytest.raises(CapacityError) as e:
    co.transition({"kv_pool": RegionSpec(20_000)})
  assert e.value.needed == 20_224 and log == [] and snapshot(a) == before


# ---- standard layouts and compiled workspaces --------------------------------------

def test_phase_layouts_pool_is_whole_pages_and_persistent_survives():
  page = 425_984
  arena_bytes = 64 * 2**20
  lay = A.phase_layouts(arena_bytes, prefill_workspace_bytes=40 * 2**20,
                        decode_workspace_bytes=2 * 2**20 + 5,
                        persistent={"stage": 19_611_648}, page_bytes=page)
  used_pre = A.align_up(19_611_648, 256) + 40 * 2**20
  assert lay.prefill_kv_pages == (arena_bytes - used_pre) // page == 13
  used_dec = A.align_up(19_611_648, 256) + A.align_up(2 * 2**20 + 5, 256)
  assert lay.decode_kv_pages == (arena_bytes - used_dec) // page
  assert lay.decode["kv_pool"].nbytes == lay.decode_kv_pages * page
  a = Arena(arena_bytes)
  co = PhaseCoordinator(a)
  co.transition(lay.prefill)
  stage = a.view("stage")
  co.transition(lay.decode)
  assert stage.check().offset == a.regions["stage"].offset
  assert a.used_bytes() <= arena_bytes
  co.transition(lay.prefill)
  assert stage.check() is stage
  with pytest.raises(CapacityError, match="missing"):
    A.phase_layouts(arena_bytes, 64 * 2**20 - page + 1, 0, page_bytes=page)


def test_workspace_bytes_from_compiled():
  import jax
  import jax.numpy as jnp

  def f(x):
    return jnp.tanh(x @ x.T) * 2.0

  small = jax.jit(f).lower(jnp.ones((16, 8), jnp.float32)).compile()
  big = jax.jit(f).lower(jnp.ones((256, 8), jnp.float32)).compile()
  ma = small.memory_analysis()
  ws = A.workspace_bytes_from_compiled(small)
  assert ws == ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
  assert ws >= 16 * 16 * 4                  # at least the [16, 16] float32 output
  ws_big = A.workspace_bytes_from_compiled(big)
  assert ws_big >= 256 * 256 * 4 > ws
  assert A.workspace_bytes_from_compiled([small, big]) == ws_big
  donate = jax.jit(lambda x: x + 1, donate_argnums=0).lower(jnp.ones((64,), jnp.float32)).compile()
  dm = donate.memory_analysis()
  assert A.workspace_bytes_from_compiled(donate) == (
      dm.temp_size_in_bytes + dm.output_size_in_bytes - dm.alias_size_in_bytes)


def test_jax_adapter_fence_and_buffer():
  import jax.numpy as jnp
  import numpy as np

  a = Arena(4096)
  committed(a, {"r": (300, False)})
  buf = JaxArenaBuffer(a)
  v = a.view("r")
  buf.write(v.slice(0, 4), np.array([1, 2, 3, 4], np.uint8))
  out = buf.read(v)
  fence = A.JaxFence(out)
  assert fence.wait(None) and fence.is_complete()
  assert np.asarray(out[:5]).tolist() == [1, 2, 3, 4, 0] and out.shape == (300,)
  lease = a.acquire("r")
  lease.add_fence(A.JaxFence(jnp.ones(3) * 2))
  lease.release(wait=True, timeout=5.0)
  committed(a, {"r": (300, False)})
  with pytest.raises(StaleViewError):
    buf.read(v)
  with pytest.raises(ValueError, match="write of 3 B"):
    buf.write(a.view("r"), np.zeros(3, np.uint8))


class JaxArenaBuffer:  # a test double: the arena over one jax buffer
  """Holds the parent buffer as one `uint8[capacity_bytes]` jax array.

  `read(view)` returns the view's bytes; `write(view, data)` returns nothing
  and replaces the parent with an updated array (functional update). Both
  check the view first, so a stale view cannot touch the bytes.
  """

  def __init__(self, arena, device=None):
    self.arena = arena
    buf = jnp.zeros((arena.capacity_bytes,), jnp.uint8)
    self.parent_n = jax.device_put(buf, device) if device is not None else buf

  def read(self, view):
    view.check()
    return self.parent_n[view.offset:view.offset + view.size]

  def write(self, view, data_n) -> None:
    view.check()
    data_n = jnp.asarray(data_n, jnp.uint8).reshape(-1)
    if data_n.shape[0] != view.size:
      raise ValueError(f"write of {data_n.shape[0]} B into view {view.name!r} of {view.size} B")
    self.parent_n = self.parent_n.at[view.offset:view.offset + view.size].set(data_n)
