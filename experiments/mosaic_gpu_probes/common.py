import jax, numpy as np
from jax._src.pallas.mosaic_gpu.interpret import params as ip
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

def interp(f, *args):
  try:
    with ip.force_gpu_interpret_mode(ip.InterpretGPUParams()):
      return jax.jit(f)(*args), None
  except Exception as e:
    ipc.reset_gpu_interpret_mode_state()
    return None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"

def lower(f, *args):
  """Runs the real Pallas->Mosaic GPU lowering (Python side) for CUDA, no GPU needed."""
  try:
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return "LOWER OK"
  except Exception as e:
    msg = str(e)
    # find the innermost useful message
    return f"LOWER FAIL {type(e).__name__}: " + " | ".join(l for l in msg.splitlines() if l.strip())[:600]

def check(name, f, args, ref=None):
  out, err = interp(f, *args)
  if err: print(f"[{name}] INTERP FAIL {err}")
  else:
    ok = "" if ref is None else ("match" if all(np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-2) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref))) else "MISMATCH")
    print(f"[{name}] INTERP OK {ok}")
  print(f"[{name}] {lower(f, *args)}")
  return out
