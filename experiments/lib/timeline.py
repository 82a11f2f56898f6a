"""A device timeline of a few calls: which kernels and copies ran on which stream, and how much of
the host-to-device copy time ran beside compute.

`profile(fn)` runs `fn` under `jax.profiler` and reads the trace back (`jax.profiler.ProfileData`):
every event of the GPU planes' stream lines, classified as `h2d`, `d2h`, `d2d` (copies) or
`kernel`. `summarize` reduces it to the numbers a streamed forward is judged by:

* `window_ms`     first to last device event;
* `h2d_ms`        time during which at least one host-to-device copy ran (union of intervals);
* `kernel_ms`     the same for kernels;
* `overlap_ms`    time during which both ran;
* `hidden_share`  overlap / h2d: the share of copy time hidden behind compute;
* `kernel_idle_ms` window minus kernel time: where compute waited.

`segments` merges consecutive events of one kind on one stream, for a readable timeline. On a CPU
backend there are no device planes; the summary then says so (`device_events` 0).
"""

from __future__ import annotations

import glob
import os
import tempfile
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple


class Event(NamedTuple):
  stream: str
  kind: str        # h2d | d2h | d2d | kernel
  name: str
  start_ns: float
  dur_ns: float

  @property
  def end_ns(self) -> float:
    return self.start_ns + self.dur_ns


def classify(name: str) -> str:
  n = name.lower().replace(" ", "")
  if "memcpy" in n or "memset" in n:
    if "htod" in n or "h2d" in n:
      return "h2d"
    if "dtoh" in n or "d2h" in n:
      return "d2h"
    return "d2d"
  return "kernel"


def _profile_data(log_dir: str):
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no .xplane.pb trace under {log_dir}")
  return ProfileData.from_file(paths[-1])


def read_events(log_dir: str) -> List[Event]:
  """Device stream events of the newest trace under `log_dir`."""
  events = []
  for plane in _profile_data(log_dir).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue   # derived lines (XLA Modules / Ops / Steps) repeat the stream events
      for e in line.events:
        events.append(Event(line.name, classify(e.name), e.name, float(e.start_ns), float(e.duration_ns)))
  events.sort(key=lambda e: e.start_ns)
  return events


def host_calls(log_dir: str) -> Dict[str, Tuple[int, float]]:
  """Host time of the compiled-function calls (`PjitFunction(name)` on the Python thread) and of
  the transfers jax traced there: name -> (calls, total ms)."""
  out: Dict[str, Tuple[int, float]] = {}
  for plane in _profile_data(log_dir).planes:
    if not plane.name.startswith("/host"):
      continue
    for line in plane.lines:
      if line.name != "python":
        continue
      for e in line.events:
        if e.name.startswith(("PjitFunction", "device_put", "BufferFromPyval", "batched_device_put")):
          n, ms = out.get(e.name, (0, 0.0))
          out[e.name] = (n + 1, ms + float(e.duration_ns) / 1e6)
  return out


def profile(fn: Callable[[], object], log_dir: Optional[str] = None) -> Tuple[List[Event], str]:
  """Run `fn()` (which must block on its results) under the profiler; -> (events, trace folder)."""
  import jax  # pylint: disable=import-outside-toplevel
  log_dir = log_dir or tempfile.mkdtemp(prefix="kvjax_trace_")
  jax.profiler.start_trace(log_dir)
  try:
    fn()
  finally:
    jax.profiler.stop_trace()
  return read_events(log_dir), log_dir


def _union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
  out: List[Tuple[float, float]] = []
  for s, e in sorted(intervals):
    if out and s <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], e))
    else:
      out.append((s, e))
  return out


def _length(intervals) -> float:
  return sum(e - s for s, e in intervals)


def _intersection(a, b) -> float:
  i = j = 0
  total = 0.0
  while i < len(a) and j < len(b):
    lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if hi > lo:
      total += hi - lo
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def summarize(events: List[Event]) -> Dict[str, float]:
  if not events:
    return {"device_events": 0}
  t0 = min(e.start_ns for e in events)
  t1 = max(e.end_ns for e in events)
  by_kind = {k: _union([(e.start_ns, e.end_ns) for e in events if e.kind == k])
             for k in ("h2d", "d2h", "d2d", "kernel")}
  h2d, ker = by_kind["h2d"], by_kind["kernel"]
  overlap = _intersection(h2d, ker)
  h2d_ms = _length(h2d) / 1e6
  out = {
      "device_events": len(events),
      "window_ms": (t1 - t0) / 1e6,
      "h2d_ms": h2d_ms,
      "kernel_ms": _length(ker) / 1e6,
      "d2d_ms": _length(by_kind["d2d"]) / 1e6,
      "d2h_ms": _length(by_kind["d2h"]) / 1e6,
      "overlap_ms": overlap / 1e6,
      "hidden_share": (overlap / 1e6) / h2d_ms if h2d_ms > 0 else 1.0,
      "kernel_idle_ms": (t1 - t0 - _length(ker)) / 1e6,
      "h2d_events": sum(e.kind == "h2d" for e in events),
  }
  for s in sorted({e.stream for e in events}):
    out[f"busy_ms[{s}]"] = _length(_union([(e.start_ns, e.end_ns) for e in events if e.stream == s])) / 1e6
  return out


def phase_windows(log_dir: str, prefix: str) -> List[Tuple[str, float, float]]:
  """The host trace annotations of the newest trace under `log_dir` whose name starts with `prefix`
  (`kvjax.speculative.PhaseClock`'s "spec:" for a speculative round's phases), in time order:
  (name without the prefix, start ns, end ns)."""
  out = []
  for plane in _profile_data(log_dir).planes:
    if not plane.name.startswith("/host"):
      continue
    for line in plane.lines:
      for e in line.events:
        if e.name.startswith(prefix):
          out.append((e.name[len(prefix):], float(e.start_ns), float(e.start_ns) + float(e.duration_ns)))
  return sorted(out, key=lambda w: w[1])


def phase_device(events: List[Event], windows: List[Tuple[str, float, float]]) -> Dict[str, Dict[str, float]]:
  """What the device did during each named host phase, summed over its windows: `n`, `wall_ms`
  (host), `kernel_ms` and `h2d_ms` (time with a kernel / a host-to-device copy running), and
  `kernel_idle_ms` (wall - kernel: where the device waited for the host or for copies)."""
  ker = _union([(e.start_ns, e.end_ns) for e in events if e.kind == "kernel"])
  h2d = _union([(e.start_ns, e.end_ns) for e in events if e.kind == "h2d"])
  out: Dict[str, Dict[str, float]] = {}
  for name, s, e in windows:
    d = out.setdefault(name, {"n": 0, "wall_ms": 0.0, "kernel_ms": 0.0, "h2d_ms": 0.0})
    d["n"] += 1
    d["wall_ms"] += (e - s) / 1e6
    d["kernel_ms"] += _intersection(ker, [(s, e)]) / 1e6
    d["h2d_ms"] += _intersection(h2d, [(s, e)]) / 1e6
  for d in out.values():
    d["kernel_idle_ms"] = d["wall_ms"] - d["kernel_ms"]
  return out


KERNEL_FAMILIES = (   # (family, substrings of a lower-cased kernel name), first match wins
    ("solve", ("trsm", "triangular")),             # the Gated DeltaNet chunks' triangular solves
    ("gemm_f32", ("sgemm", "f32f32_f32", "gemm_f32")),   # float32 GEMMs (HIGHEST precision: no tensor cores)
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma")),
    ("attention", ("mosaic", "span_attention", "attention")),
    ("triton", ("triton",)),
    ("reduce", ("reduce", "scan", "sort")),
    ("fusion", ("fusion", "loop_", "input_", "wrapped_", "concatenate", "slice", "transpose", "copy")),
)


def kernel_family(name: str) -> str:
  n = name.lower()
  for fam, keys in KERNEL_FAMILIES:
    if any(k in n for k in keys):
      return fam
  return "other"


def kernel_table(events: List[Event], top: int = 15) -> Dict[str, object]:
  """Kernel time by family (`KERNEL_FAMILIES`) and the `top` kernels by total time: where a compute-
  bound call spends its device time. Sums of kernel durations (overlapping kernels count twice)."""
  fam: Dict[str, List[float]] = {}
  by_name: Dict[str, List[float]] = {}
  for e in events:
    if e.kind != "kernel":
      continue
    for d, key in ((fam, kernel_family(e.name)), (by_name, e.name)):
      acc = d.setdefault(key, [0, 0.0])
      acc[0] += 1
      acc[1] += e.dur_ns / 1e6
  total = sum(v[1] for v in fam.values()) or 1.0
  return {"total_ms": total,
          "families": {k: {"n": v[0], "ms": v[1], "share": v[1] / total}
                       for k, v in sorted(fam.items(), key=lambda kv: -kv[1][1])},
          "top": [{"name": k[:90], "n": v[0], "ms": v[1], "share": v[1] / total}
                  for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]]}


def format_kernel_table(table: Dict[str, object]) -> str:
  lines = [f"{'family':<10} {'kernels':>8} {'ms':>9} {'share':>6}"]
  for k, v in table["families"].items():
    lines.append(f"{k:<10} {v['n']:>8} {v['ms']:>9.2f} {v['share']:>6.1%}")
  lines.append(f"{'kernel':<90} {'n':>6} {'ms':>9} {'share':>6}")
  for v in table["top"]:
    lines.append(f"{v['name']:<90} {v['n']:>6} {v['ms']:>9.2f} {v['share']:>6.1%}")
  return "\n".join(lines)


def segments(events: List[Event], gap_ns: float = 20e3) -> List[Dict[str, object]]:
  """Consecutive events of one kind on one stream, closer than `gap_ns`, as one segment."""
  if not events:
    return []
  t0 = min(e.start_ns for e in events)
  open_seg: Dict[Tuple[str, str], Dict[str, object]] = {}
  out = []
  for e in events:
    key = (e.stream, e.kind)
    seg = open_seg.get(key)
    if seg is not None and e.start_ns - seg["_end"] <= gap_ns:
      seg["_end"] = max(seg["_end"], e.end_ns)
      seg["n"] += 1
      seg["busy_ms"] += e.dur_ns / 1e6
      continue
    seg = {"stream": e.stream, "kind": e.kind, "first": e.name[:60], "start_ms": (e.start_ns - t0) / 1e6,
           "_end": e.end_ns, "n": 1, "busy_ms": e.dur_ns / 1e6}
    open_seg[key] = seg
    out.append(seg)
  for seg in out:
    seg["end_ms"] = (seg.pop("_end") - t0) / 1e6
  out.sort(key=lambda s: s["start_ms"])
  return out


def format_segments(segs: List[Dict[str, object]], limit: int = 80) -> str:
  lines = [f"{'start ms':>9} {'end ms':>9} {'busy ms':>8} {'n':>4}  {'kind':<6} {'stream':<28} first"]
  for s in segs[:limit]:
    lines.append(f"{s['start_ms']:>9.3f} {s['end_ms']:>9.3f} {s['busy_ms']:>8.3f} {s['n']:>4}  {s['kind']:<6} "
                 f"{str(s['stream'])[:28]:<28} {s['first']}")
  if len(segs) > limit:
    lines.append(f"... {len(segs) - limit} more segments")
  return "\n".join(lines)
