"""Phase arena: one fixed parent allocation, alternative region layouts.

Prefill wants a large workspace and a small KV pool, decode the reverse. The
arena is one parent allocation of `capacity_bytes`; a *layout* names regions
(offset, size) inside it, and a phase change commits a different layout of
the same bytes. This module is backend-neutral bookkeeping (no jax import at
module load); `JaxFence` is a thin optional adapter
(a fence over queued jax work).

Objects:

* `Arena(capacity_bytes, alignment=256)`: the committed layout and its
  `generation` (bumped at every commit; distinct from cache, content and
  executable generations, cross-cutting rule 2).
* `Transaction` (`arena.begin()`): `reserve(name, nbytes, persistent)`,
  `plan()`, `commit()`, `abort()`. Nothing touches the committed layout
  until `commit()` succeeds; a failed reserve or commit raises and leaves
  the committed layout untouched (`CapacityError` reports bytes needed vs
  available).
* `View` (`arena.view(name)`): an offset and bound in the parent, the
  generation of the region placement it was made from, bounds-checked
  `slice()`. Using a view whose region was re-placed raises
  `StaleViewError`.
* `Lease` (`arena.acquire(name)`): keeps a region from being repurposed.
  Consumers attach completion `Fence`s for queued work. A commit refuses to
  change a region that a live lease holds (`RegionBusyError`), and a lease
  cannot be released while one of its fences is unsignalled. A lease whose
  region was released by a transition raises `StaleLeaseError` on use.
* `PhaseCoordinator.transition(spec)`: prepare -> stop new work -> drain
  (wait fences) -> invalidate (consumer callbacks drop executables/views
  bound to changed regions) -> release changed leases -> commit -> rebind ->
  activate. Persistent regions that keep their size keep their offset and
  their placement generation, so their views and leases stay valid. A
  failure before the commit restores the previous layout's consumers
  (previous committed state valid); a failure at or after the commit that
  cannot be undone marks the arena explicitly invalid (`ArenaInvalidError`
  on use) until a later transition commits a fresh layout. Nothing is
  half-applied.

Placement: regions are aligned to `alignment`; a region occupies its size
rounded up to the alignment. Surviving persistent regions stay put; the
others are placed first-fit in reservation order.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union


class ArenaError(RuntimeError):
  """Base class of arena errors."""


class CapacityError(ArenaError, ValueError):
  """A layout does not fit: carries `needed` and `available` bytes."""

  def __init__(self, message: str, needed: int, available: int):
    super().__init__(message)
    self.needed = needed
    self.available = available


class StaleViewError(ArenaError):
  """A view of a region placement that is no longer committed."""


class StaleLeaseError(ArenaError):
  """A lease that was released (by its owner or by a transition)."""


class RegionBusyError(ArenaError):
  """A region still held by a lease, or a fence still pending."""


class ArenaInvalidError(ArenaError):
  """The arena was marked invalid after a failure that could not be undone."""


class TransitionError(ArenaError):
  """A phase transition failed; `step` names where."""

  def __init__(self, message: str, step: str):
    super().__init__(message)
    self.step = step


def align_up(n: int, a: int) -> int:
  return (n + a - 1) // a * a


# ---- fences -----------------------------------------------------------------

class Fence:
  """Completion fence: proves a consumer stopped using a region."""

  def is_complete(self) -> bool:
    raise NotImplementedError

  def wait(self, timeout: Optional[float] = None) -> bool:
    """Blocks until complete or `timeout` seconds pass; returns completion."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not self.is_complete():
      if deadline is not None and time.monotonic() >= deadline:
        return False
      time.sleep(0.001)
    return True


class ManualFence(Fence):
  """A fence signalled explicitly by its producer (host code, tests)."""

  def __init__(self, name: str = "fence"):
    self.name = name
    self._event = threading.Event()

  def signal(self) -> None:
    self._event.set()

  def is_complete(self) -> bool:
    return self._event.is_set()

  def wait(self, timeout: Optional[float] = None) -> bool:
    return self._event.wait(timeout)

  def __repr__(self):
    return f"ManualFence({self.name!r}, complete={self.is_complete()})"


class JaxFence(Fence):
  """Complete when every wrapped jax array is ready (dispatch finished).

  `is_complete` polls `jax.Array.is_ready()`; `wait` blocks like
  `jax.block_until_ready` (and honours `timeout` by polling).
  """

  def __init__(self, arrays, name: str = "jax"):
    import jax  # pylint: disable=import-outside-toplevel
    self.name = name
    self._arrays = [a for a in jax.tree_util.tree_leaves(arrays) if hasattr(a, "is_ready")]

  def is_complete(self) -> bool:
    return all(a.is_ready() for a in self._arrays)

  def wait(self, timeout: Optional[float] = None) -> bool:
    if timeout is None:
      import jax  # pylint: disable=import-outside-toplevel
      jax.block_until_ready(self._arrays)
      return True
    return super().wait(timeout)

  def __repr__(self):
    return f"JaxFence({self.name!r}, arrays={len(self._arrays)})"


# ---- layout metadata ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RegionSpec:
  """A requested region: `nbytes` and whether it may survive transitions."""

  nbytes: int
  persistent: bool = False


LayoutSpec = Mapping[str, Union[int, RegionSpec]]


@dataclasses.dataclass(frozen=True)
class Region:
  """A committed region. `generation` = layout generation of its placement."""

  name: str
  offset: int
  size: int
  persistent: bool
  generation: int

  def end(self, alignment: int) -> int:
    return self.offset + align_up(self.size, alignment)


@dataclasses.dataclass(frozen=True)
class Plan:
  """A placed, uncommitted layout.

  `regions`: name -> Region (survivors keep their old generation, the new
  ones carry `generation`); `changed`: names of currently committed regions
  that this plan removes or re-places; `survivors`: names kept as is.
  """

  base_generation: int
  generation: int
  regions: Mapping[str, Region]
  changed: Tuple[str, ...]
  survivors: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class View:
  """A bounded slice `[offset, offset + size)` of the arena's parent buffer."""

  arena: "Arena"
  name: str
  offset: int
  size: int
  generation: int

  def check(self) -> "View":
    """Raises `StaleViewError` unless the region placement is still committed."""
    self.arena._check_valid()  # pylint: disable=protected-access
    r = self.arena.regions.get(self.name)
    if r is None or r.generation != self.generation:
      raise StaleViewError(
          f"view of region {self.name!r} (placement generation {self.generation}) is stale: "
          f"arena is at generation {self.arena.generation}"
          + ("" if r is None else f", region re-placed at generation {r.generation}"))
    return self

  def slice(self, offset: int, size: int) -> "View":
    """Sub-view at `offset` (relative to this view) of `size` bytes."""
    self.check()
    if offset < 0 or size < 0 or offset + size > self.size:
      raise ValueError(
          f"slice [{offset}, {offset + size}) is outside view {self.name!r} of {self.size} B "
          f"(needs offset >= 0 and offset + size <= {self.size})")
    return dataclasses.replace(self, offset=self.offset + offset, size=size)


class Lease:
  """Holds a committed region; fences record queued work that reads it."""

  def __init__(self, arena: "Arena", region: Region, owner: str):
    self.arena = arena
    self.name = region.name
    self.offset = region.offset
    self.size = region.size
    self.generation = region.generation
    self.owner = owner
    self.released = False
    self.release_reason = ""
    self.fences: List[Fence] = []

  def check(self) -> "Lease":
    if self.released:
      raise StaleLeaseError(
          f"lease {self.owner!r} on region {self.name!r} (generation {self.generation}) "
          f"was released ({self.release_reason})")
    self.arena._check_valid()  # pylint: disable=protected-access
    return self

  def add_fence(self, fence: Fence) -> None:
    self.check()
    self.fences.append(fence)

  def pending(self) -> List[Fence]:
    self.fences = [f for f in self.fences if not f.is_complete()]
    return list(self.fences)

  def view(self) -> View:
    self.check()
    return View(self.arena, self.name, self.offset, self.size, self.generation).check()

  def release(self, wait: bool = False, timeout: Optional[float] = None) -> None:
    """Releases the region. Refused while a fence is pending (unless `wait`)."""
    if self.released:
      return
    pending = self.pending()
    if pending and wait:
      for f in pending:
        f.wait(timeout)
      pending = self.pending()
    if pending:
      raise RegionBusyError(
          f"lease {self.owner!r} on region {self.name!r} still has {len(pending)} "
          f"unsignalled fence(s): {pending}")
    self._drop("released by owner")

  def _drop(self, reason: str) -> None:
    self.released = True
    self.release_reason = reason
    self.arena._leases.discard(self)  # pylint: disable=protected-access

  def __repr__(self):
    return (f"Lease({self.owner!r} -> {self.name!r} [{self.offset}, +{self.size}) "
            f"gen {self.generation}{', released' if self.released else ''})")


# ---- arena ------------------------------------------------------------------

class Arena:
  """Region bookkeeping for one parent allocation of `capacity_bytes`."""

  def __init__(self, capacity_bytes: int, alignment: int = 256):
    if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
      raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
    if not isinstance(alignment, int) or alignment < 1:
      raise ValueError(f"alignment must be an int >= 1, got {alignment!r}")
    self.capacity_bytes = capacity_bytes
    self.alignment = alignment
    self.generation = 0
    self.regions: Dict[str, Region] = {}
    self.invalid_reason: Optional[str] = None
    self.accepting = True          # False while a transition has stopped new work
    self._leases = set()
    self._txn: Optional["Transaction"] = None
    self._commit_hook: Optional[Callable[[Plan], None]] = None

  # -- state
  @property
  def valid(self) -> bool:
    return self.invalid_reason is None

  def _check_valid(self) -> None:
    if self.invalid_reason is not None:
      raise ArenaInvalidError(f"arena is invalid: {self.invalid_reason}")

  def mark_invalid(self, reason: str) -> None:
    """Explicitly invalidates the arena: every view and lease becomes unusable."""
    self.invalid_reason = reason
    for lease in list(self._leases):
      lease._drop(f"arena invalidated: {reason}")  # pylint: disable=protected-access

  def leases(self, name: Optional[str] = None) -> List[Lease]:
    return [l for l in self._leases if name is None or l.name == name]

  def used_bytes(self) -> int:
    return sum(align_up(r.size, self.alignment) for r in self.regions.values())

  # -- access
  def view(self, name: str) -> View:
    self._check_valid()
    r = self.regions.get(name)
    if r is None:
      raise KeyError(f"no region {name!r} in the committed layout; regions: {sorted(self.regions)}")
    return View(self, name, r.offset, r.size, r.generation)

  def acquire(self, name: str, owner: str = "consumer") -> Lease:
    self._check_valid()
    if not self.accepting:
      raise RegionBusyError(f"arena is transitioning: new work (lease of {name!r} for {owner!r}) is stopped")
    r = self.regions.get(name)
    if r is None:
      raise KeyError(f"no region {name!r} in the committed layout; regions: {sorted(self.regions)}")
    lease = Lease(self, r, owner)
    self._leases.add(lease)
    return lease

  # -- transactions
  def begin(self) -> "Transaction":
    if self._txn is not None:
      raise ArenaError("a transaction is already open on this arena; commit or abort it first")
    self._txn = Transaction(self)
    return self._txn

  def plan(self, spec: LayoutSpec) -> Plan:
    """Places `spec` against the committed layout without committing it."""
    txn = Transaction(self, register=False)
    for name, s in spec.items():
      s = s if isinstance(s, RegionSpec) else RegionSpec(int(s))
      txn.reserve(name, s.nbytes, s.persistent)
    return txn.plan()

  def _commit(self, plan: Plan, release_leases: bool = False) -> None:
    """Swaps in `plan`. Refuses (changing nothing) if a changed region is held.

    With `release_leases` (the coordinator, after draining) leases on changed
    regions whose fences have all signalled are dropped with the swap.
    """
    if plan.base_generation != self.generation:
      raise ArenaError(
          f"plan was made against generation {plan.base_generation}, arena is at {self.generation}")
    busy = [l for l in self._leases if l.name in plan.changed
            and (not release_leases or l.pending())]
    if busy:
      pending = [l for l in busy if l.pending()]
      raise RegionBusyError(
          f"cannot repurpose region(s) {sorted({l.name for l in busy})}: held by {len(busy)} "
          f"lease(s) ({len(pending)} with unsignalled fences): {busy}")
    if self._commit_hook is not None:
      self._commit_hook(plan)   # fault injection / observers; may raise
    # Atomic swap: nothing above mutated the arena.
    for lease in [l for l in self._leases if l.name in plan.changed]:
      lease._drop(f"region {lease.name!r} changed by the commit of generation {plan.generation}")  # pylint: disable=protected-access
    self.regions = dict(plan.regions)
    self.generation = plan.generation
    self.invalid_reason = None


class Transaction:
  """An uncommitted layout being built on an arena."""

  def __init__(self, arena: Arena, register: bool = True):
    self.arena = arena
    self._specs: Dict[str, RegionSpec] = {}
    self._registered = register
    self.closed = False

  def _check_open(self):
    if self.closed:
      raise ArenaError("transaction is closed")

  def reserved_bytes(self) -> int:
    return sum(align_up(s.nbytes, self.arena.alignment) for s in self._specs.values())

  def reserve(self, name: str, nbytes: int, persistent: bool = False) -> "Transaction":
    """Adds a region. A refused reserve leaves the transaction as it was."""
    self._check_open()
    if not isinstance(name, str) or not name:
      raise ValueError(f"region name must be a non-empty str, got {name!r}")
    if name in self._specs:
      raise ValueError(f"region {name!r} reserved twice in one transaction")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
      raise ValueError(f"region {name!r}: nbytes must be an int >= 1, got {nbytes!r}")
    a = self.arena
    need = align_up(nbytes, a.alignment)
    have = a.capacity_bytes - self.reserved_bytes()
    if need > have:
      raise CapacityError(
          f"region {name!r} needs {need} B ({nbytes} B aligned to {a.alignment}) but only "
          f"{have} B of the {a.capacity_bytes} B arena are unreserved; "
          f"{need - have} B missing", needed=need, available=have)
    self._specs[name] = RegionSpec(nbytes, bool(persistent))
    return self

  def plan(self) -> Plan:
    """Places the reserved regions (survivors first). Raises `CapacityError`."""
    self._check_open()
    a = self.arena
    al = a.alignment
    new_gen = a.generation + 1
    placed: Dict[str, Region] = {}
    survivors = []
    for name, s in self._specs.items():
      old = a.regions.get(name)
      if (old is not None and old.persistent and s.persistent and old.size == s.nbytes
          and a.valid):
        placed[name] = old
        survivors.append(name)
    for name, s in self._specs.items():
      if name in placed:
        continue
      busy = sorted((r.offset, r.end(al)) for r in placed.values())
      need = align_up(s.nbytes, al)
      cursor, offset, largest = 0, None, 0
      for lo, hi in busy + [(a.capacity_bytes, a.capacity_bytes)]:
        gap = lo - cursor
        if offset is None and gap >= need:
          offset = cursor
        largest = max(largest, gap)
        cursor = max(cursor, hi)
      if offset is None:
        raise CapacityError(
            f"region {name!r} needs {need} B contiguous but the largest free gap is {largest} B "
            f"(fragmented by surviving regions {survivors}); {need - largest} B missing",
            needed=need, available=largest)
      placed[name] = Region(name, offset, s.nbytes, s.persistent, new_gen)
    changed = tuple(n for n in a.regions if n not in survivors)
    return Plan(a.generation, new_gen, placed, changed, tuple(survivors))

  def commit(self) -> Plan:
    """Commits atomically; on failure the previous layout stays committed."""
    plan = self.plan()
    self.arena._commit(plan)  # pylint: disable=protected-access
    self._close()
    return plan

  def abort(self) -> None:
    self._close()

  def _close(self):
    self.closed = True
    if self._registered and self.arena._txn is self:  # pylint: disable=protected-access
      self.arena._txn = None  # pylint: disable=protected-access


# ---- phase coordinator ---------------------------------------------------------

class PhaseConsumer:
  """Callbacks a consumer (KV pool, scheduler, compiled graphs) registers.

  Every method is optional (no-op by default). `plan` is the `Plan` being
  applied; `plan.changed` names the regions whose bytes change jobs.
  """

  name = "consumer"

  def prepare(self, plan: Plan) -> None:
    """Checks the new layout is acceptable (may raise to refuse it)."""

  def stop(self) -> None:
    """Stops issuing new work on the arena."""

  def fences(self) -> Sequence[Fence]:
    """Fences of work still queued (drain waits for them)."""
    return ()

  def invalidate(self, plan: Plan) -> None:
    """Drops executables and views bound to `plan.changed` regions."""

  def release(self, plan: Plan) -> None:
    """Releases this consumer's leases on `plan.changed` regions."""

  def rebind(self, arena: Arena, plan: Plan) -> None:
    """Takes new views / leases on the committed layout."""

  def activate(self) -> None:
    """Resumes work."""


STEPS = ("prepare", "stop", "drain", "invalidate", "release", "commit", "rebind", "activate")


class PhaseCoordinator:
  """Runs safe handoffs between layouts of one arena.

  `fault(step)` (optional) is called at the start of each step in `STEPS`
  and may raise to inject a failure there (tests).
  """

  def __init__(self, arena: Arena, drain_timeout_s: Optional[float] = 10.0,
               fault: Optional[Callable[[str], None]] = None):
    self.arena = arena
    self.drain_timeout_s = drain_timeout_s
    self.fault = fault
    self.consumers: List[PhaseConsumer] = []
    self.history: List[str] = []   # steps completed in the last transition

  def register(self, consumer: PhaseConsumer) -> None:
    self.consumers.append(consumer)

  def _step(self, step: str) -> None:
    if self.fault is not None:
      self.fault(step)

  def transition(self, spec: LayoutSpec) -> Plan:
    """Commits `spec` through the full handoff; see the module docstring."""
    a = self.arena
    self.history = []
    plan = a.plan(spec)          # CapacityError here: nothing touched
    old_plan = Plan(a.generation, a.generation, dict(a.regions), (), tuple(a.regions))
    step = "prepare"
    committed = False
    stopped = False
    invalidated = False
    try:
      self._step("prepare")
      for c in self.consumers:
        c.prepare(plan)
      self.history.append("prepare")

      step = "stop"
      self._step("stop")
      a.accepting = False
      stopped = True
      for c in self.consumers:
        c.stop()
      self.history.append("stop")

      step = "drain"
      self._step("drain")
      fences = [f for c in self.consumers for f in c.fences()]
      fences += [f for l in a.leases() if l.name in plan.changed for f in l.fences]
      deadline = None if self.drain_timeout_s is None else time.monotonic() + self.drain_timeout_s
      for f in fences:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not f.wait(left):
          raise TransitionError(f"drain timed out after {self.drain_timeout_s} s waiting for {f!r}",
                                "drain")
      self.history.append("drain")

      step = "invalidate"
      self._step("invalidate")
      invalidated = True
      for c in self.consumers:
        c.invalidate(plan)
      self.history.append("invalidate")

      step = "release"
      self._step("release")
      for c in self.consumers:
        c.release(plan)
      for lease in a.leases():
        if lease.name in plan.changed and lease.pending():
          raise TransitionError(f"{lease!r} still has unsignalled fences after drain", "release")
      self.history.append("release")

      step = "commit"
      self._step("commit")
      # Leases left on changed regions (all fences signalled) are dropped
      # atomically with the swap, so a failed commit leaves them intact.
      a._commit(plan, release_leases=True)  # pylint: disable=protected-access
      committed = True
      self.history.append("commit")

      step = "rebind"
      self._step("rebind")
      a.accepting = True        # consumers take leases on the new layout
      for c in self.consumers:
        c.rebind(a, plan)
      self.history.append("rebind")

      step = "activate"
      self._step("activate")
      for c in self.consumers:
        c.activate()
      self.history.append("activate")
      return plan
    except Exception as e:  # pylint: disable=broad-except
      if committed:
        a.accepting = True
        a.mark_invalid(f"transition to generation {plan.generation} failed at {step}: {e}")
      else:
        self._recover(old_plan, stopped, invalidated, step, e)
      if isinstance(e, TransitionError):
        raise
      raise TransitionError(f"transition failed at {step}: {e}", step) from e

  def _recover(self, old_plan: Plan, stopped: bool, invalidated: bool, step: str,
               err: Exception) -> None:
    """Before the commit: the old layout is still committed; restart on it."""
    a = self.arena
    a.accepting = True
    try:
      if invalidated:
        for c in self.consumers:
          c.rebind(a, old_plan)
      if stopped:
        for c in self.consumers:
          c.activate()
    except Exception as e2:  # pylint: disable=broad-except
      a.mark_invalid(f"transition failed at {step} ({err}) and restoring the previous "
                     f"layout failed ({e2})")


# ---- standard phase layouts ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PhaseLayouts:
  """Prefill and decode layout specs of one arena, and their KV pool sizes."""

  prefill: Dict[str, RegionSpec]
  decode: Dict[str, RegionSpec]
  prefill_kv_pages: int
  decode_kv_pages: int
  page_bytes: int


KV_POOL = "kv_pool"
WORKSPACE = "workspace"


def phase_layouts(arena_bytes: int, prefill_workspace_bytes: int, decode_workspace_bytes: int,
                  persistent: Optional[Mapping[str, int]] = None, page_bytes: int = 426_496,
                  alignment: int = 256) -> PhaseLayouts:
  """The two standard layouts: persistent regions, a workspace, a KV pool.

  Persistent regions come first (same size in both phases, so they survive
  a prefill <-> decode transition at the same offset). The KV pool gets what
  is left after the aligned persistent regions and the phase's workspace,
  rounded down to whole pages.
  """
  persistent = dict(persistent or {})
  for k in (KV_POOL, WORKSPACE):
    if k in persistent:
      raise ValueError(f"persistent region name {k!r} is reserved")

  def one(phase: str, ws: int):
    used = sum(align_up(n, alignment) for n in persistent.values()) + align_up(ws, alignment)
    free = (arena_bytes - used) // alignment * alignment
    pages = max(0, free) // page_bytes
    if pages < 1:
      need = used + page_bytes
      raise CapacityError(
          f"{phase} layout: {arena_bytes} B arena holds persistent regions and a {ws} B workspace "
          f"({used} B aligned) but not one {page_bytes} B KV page; needs {need} B, "
          f"{need - arena_bytes} B missing", needed=need, available=arena_bytes)
    spec = {n: RegionSpec(b, True) for n, b in persistent.items()}
    if ws > 0:
      spec[WORKSPACE] = RegionSpec(ws, False)
    spec[KV_POOL] = RegionSpec(pages * page_bytes, False)
    return spec, pages

  pre, pre_pages = one("prefill", prefill_workspace_bytes)
  dec, dec_pages = one("decode", decode_workspace_bytes)
  return PhaseLayouts(pre, dec, pre_pages, dec_pages, page_bytes)


def workspace_bytes_from_compiled(compiled) -> int:
  """Device scratch a phase's compiled executable(s) need, from XLA's analysis.

  Per executable: `temp_size_in_bytes + output_size_in_bytes -
  alias_size_in_bytes`: temporaries plus freshly allocated outputs (outputs
  aliased to donated arguments reuse the argument's buffer). Arguments are
  not counted: they live in other regions (weights, KV pool). A sequence of
  executables runs one at a time, so the phase's workspace is the maximum.
  """
  if isinstance(compiled, (list, tuple)):
    if not compiled:
      raise ValueError("workspace_bytes_from_compiled needs at least one compiled executable")
    return max(workspace_bytes_from_compiled(c) for c in compiled)
  ma = compiled.memory_analysis()
  if ma is None:
    raise ValueError(f"{compiled!r} has no memory analysis on this backend")
  return int(ma.temp_size_in_bytes) + int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes)
