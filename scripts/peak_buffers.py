"""What the TPU compiler's buffer assignment holds at its peak: one line per HBM
slot live at the program point where the temporary heap is fullest.

XLA's own "Live ranges at peak" list (the live-range dump) counts every value,
so a while loop's carry and its initial value, which share one slot, count
twice. This reads the dump that `main.py --mode=compile` keeps when
LCTX_COMPILE_DUMP_DIR is set, merges values by slot (offset, size) and prints
the slots live at the peak, largest first, with the op that made each (its
`op_name` metadata, shortened).

  LCTX_COMPILE_DUMP_DIR=/tmp/dump python main.py --mode=compile --gin_file=... \
      --workdir=/tmp/wd
  python scripts/peak_buffers.py /tmp/dump [--top=30]
"""

import glob
import os
import re
import sys

from absl import app, flags

flags.DEFINE_integer("top", 30, "slots to print")
flags.DEFINE_string("program", "train_step", "the dumped module's name contains this")
FLAGS = flags.FLAGS


def _one(dump_dir: str, program: str, suffix: str) -> str:
  paths = sorted(glob.glob(os.path.join(dump_dir, f"*{program}*{suffix}")))
  if not paths:
    raise ValueError(f"no *{program}*{suffix} in {dump_dir}")
  return paths[-1]


def temp_values(path: str):
  """{value name: (offset, size, shape)} of the largest preallocated-temp allocation."""
  best, cur = None, None
  with open(path) as f:
    for line in f:
      m = re.match(r"allocation \d+: size (\d+), preallocated-temp:", line)
      if m:
        cur = {}
        if best is None or int(m.group(1)) > best[0]:
          best = (int(m.group(1)), cur)
        continue
      if line.startswith("allocation"):
        cur = None
        continue
      m = re.match(
        r" value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", line
      )
      if m and cur is not None:
        name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
        cur[name] = (int(m.group(3)), int(m.group(2)), m.group(4))
  return (best[0], best[1]) if best else (0, {})


def live_ranges(path: str):
  ranges = {}
  with open(path) as f:
    body = False
    for line in f:
      if line.strip() == "BufferLiveRange:":
        body = True
        continue
      if body:
        m = re.match(r"\s+(\S+):(\d+)-(\d+)$", line)
        if not m:
          if ranges:
            break
          continue
        ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
  return ranges


def op_names(path: str) -> dict:
  names = {}
  pat = re.compile(r"^\s*%(\S+) = .*?op_name=\"([^\"]*)\"")
  with open(path) as f:
    for line in f:
      m = pat.match(line)
      if m:
        names[m.group(1)] = m.group(2)
  return names


def _short(op: str) -> str:
  op = re.sub(r"jit\(_train_step_impl\)/", "", op)
  op = op.replace("while/body/closed_call/", "").replace("checkpoint/", "")
  return op[-150:]


def _used(slots, t) -> int:
  """Bytes of the heap's address space covered by slots live at program point t."""
  return _union(
    [(o, o + z) for (o, z), vs in slots.items() if any(s <= t <= e for s, e, _, _ in vs)]
  )


def peak(dump_dir: str, program: str = "train_step") -> dict:
  """The slots live where the temporary heap is fullest.

  Returns {"heap_bytes", "point", "live_bytes", "slots": [(size, shape, value, op_name)]}
  with the slots largest first. A slot is an (offset, size) range of the heap;
  the values sharing it (a loop carry and its initial value, say) count once.
  """
  heap, values = temp_values(_one(dump_dir, program, "buffer-assignment.txt"))
  ranges = live_ranges(_one(dump_dir, program, "live-range.txt"))
  slots = {}
  for name, (off, size, shape) in values.items():
    if name in ranges:
      s, e = ranges[name]
      slots.setdefault((off, size), []).append((s, e, name, shape))
  times = sorted({t for vs in slots.values() for s, e, _, _ in vs for t in (s, e)})
  if not times:
    raise ValueError(f"no live temporary values in {dump_dir}")
  # Every program point where a slot starts or ends, sampled on big programs
  # (tens of thousands of points), then every point near the best sample.
  best_t = max(times[:: max(1, len(times) // 4000)] + times[-1:], key=lambda t: _used(slots, t))
  near = [x for x in times if abs(x - best_t) <= 200]
  best_t = max(near + [best_t], key=lambda t: _used(slots, t))
  names = op_names(_one(dump_dir, program, "after_optimizations.txt"))
  live = []
  for (_off, size), vs in slots.items():
    here = [v for v in vs if v[0] <= best_t <= v[1]]
    if here:
      _s, _e, name, shape = here[0]
      live.append((size, shape, name, names.get(name.split("{")[0], "")))
  live.sort(key=lambda r: -r[0])
  return {"heap_bytes": heap, "point": best_t, "live_bytes": _used(slots, best_t), "slots": live}


def main(argv):
  if len(argv) != 2:
    sys.exit("error: usage: peak_buffers.py DUMP_DIR [--top=N] [--program=NAME]")
  try:
    got = peak(argv[1], FLAGS.program)
  except (OSError, ValueError) as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
  gib = 2.0**30
  live = got["slots"]
  print(
    f"temporary heap {got['heap_bytes'] / gib:.2f} GiB; at program point {got['point']}: "
    f"{got['live_bytes'] / gib:.2f} GiB live in {len(live)} slots"
  )
  for size, shape, name, op in live[: FLAGS.top]:
    print(f"  {size / gib:6.2f} GiB  {shape:45s} {name:28s} {_short(op)}")
  rest = sum(x[0] for x in live[FLAGS.top :])
  print(f"  {rest / gib:6.2f} GiB  in {max(0, len(live) - FLAGS.top)} smaller slots")


def _union(intervals):
  total, end = 0, -1
  for a, b in sorted(intervals):
    if b <= end:
      continue
    total += b - max(a, end)
    end = b
  return total


if __name__ == "__main__":
  app.run(main)
