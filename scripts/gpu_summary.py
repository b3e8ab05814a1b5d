"""A few lines per method of what gpu-check.sh's benchmark JSONs say (the
whole of them stays under OUT): stalls, slowdown and where it went, restores
and how their slabs were locked, the stall's phases, and the targets; first,
the stall by phase with fused and with foreach AdamW (gpu_stall.py).

    python3 scripts/gpu_summary.py OUT
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Optional


def ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def method_line(m: Dict[str, Any]) -> str:
    if m.get("error"):
        return f"  {m['method']}: ERROR {m['error']}"
    ex = m.get("step_excess") or {}
    parts = [
        f"stalls ms {[round(s * 1e3, 1) for s in m.get('stalls_s') or []]}",
        f"slowdown {m['slowdown'] * 100:.2f} %",
        f"first step ms {ms(m.get('first_step_s'))}",
        f"excess ms first/next3/rest {ms(ex.get('first_s'))}/{ms(ex.get('next3_s'))}/{ms(ex.get('rest_s'))}",
    ]
    if m.get("durable_s") is not None:
        parts.append(f"durable s {m['durable_s']:.2f}")
    for kind in ("warm", "cold"):
        for key in ("", "_lock_during", "_lock_later", "_lock_after", "_writer"):
            t = m.get(f"restore_{kind}{key}_s")
            if t is not None:
                lock = m.get(f"restore_{kind}{key}_lock")
                text = f"restore {kind}{key.replace('_', ' ')} s {t:.2f}" + (f" ({lock})" if lock else "")
                close = m.get(f"restore_{kind}{key}_close_s")
                if close:  # the reader's close, left out of the figure
                    text += f" (+ close {close:.3f})"
                after = m.get(f"restore_{kind}{key}_step_s")
                if after is not None:  # a restarted writer's first training step
                    text += f", then a step of {after * 1e3:.1f} ms"
                ph = m.get(f"restore_{kind}{key}_phases")
                if ph:  # where its time went: the plan, the read, the slab's lock, the copies...
                    text += " [" + " ".join(f"{k} {v:.3f}" for k, v in ph.items()
                                            if isinstance(v, float) and v >= 0.0005) + "]"
                parts.append(text)
    if m.get("stall_phases"):
        parts.append("phases ms " + json.dumps({k[:-2]: round(v * 1e3, 2) for k, v in m["stall_phases"].items()}))
    return f"  {m['method']}: " + ", ".join(parts)


def stall_lines(out: str) -> None:
    """gpu_stall.py's saves, by AdamW's implementation: first and later stall,
    phases, and a fresh start's save right after its first step."""
    for opt in ("fused", "foreach"):
        path = os.path.join(out, f"stall-{opt}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            r = json.load(f)
        for mode in ("lazy", "eager"):
            m = r.get(mode)
            if m:
                phases = {k: round(v, 2) for k, v in m.get("phases_ms", {}).items()}
                print(f"stall, {opt} AdamW, {r.get('tensors')} tensors, {mode}: first {m['first_ms']:.1f} ms, "
                      f"later {m['later_ms']:.1f} ms, phases ms {json.dumps(phases)}")
            e = r.get(f"early_{mode}")
            if e:
                print(f"stall, {opt} AdamW, {mode}, a fresh start's save right after its first step: "
                      f"{e['stall_ms']:.1f} ms; the first step {e.get('first_step_ms', 0.0):.1f} ms, "
                      f"the next {e['next_step_ms']:.1f} ms (a plain one {e['plain_step_ms']:.1f} ms)")


def main(out: str) -> None:
    stall_lines(out)
    for name in ("gpu-4g.json", "gpu-15g.json"):
        path = os.path.join(out, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            r = json.load(f)
        if r.get("skipped"):
            print(f"{name}: skipped: {r['skipped']}")
            continue
        print(f"{name}: {r.get('device')}, {r.get('model')}, {r['state_bytes'] / 2**30:.2f} GiB, "
              f"step {r['step_s'] * 1e3:.1f} ms, floors {json.dumps(r['floors'])}")
        for m in r["methods"]:
            print(method_line(m))
        for t in r.get("targets", []):
            print(f"  target {t['target']}: {t['value']:.4g} (<= {t['bound']}) {'met' if t['met'] else 'NOT met'}")


if __name__ == "__main__":
    main(sys.argv[1])
