"""Which allocations a captured BoundTail.run makes: the tail API's capture test, with torch's
allocation history recorded around the capture; prints each allocation's stack (GPU only)."""

from __future__ import annotations

import torch


def main() -> None:
    import tests.kernels.test_tail_api as api

    torch.cuda.memory._record_memory_history(max_entries=100000)
    for mode in ("ep", "tp"):
        try:
            api.test_bound_tail_run_is_graph_capturable(mode)
            print(mode, "no allocation during capture")
        except AssertionError as error:
            print(mode, "allocated during capture:", str(error).splitlines()[0])
    snapshot = torch.cuda.memory._snapshot()
    for trace in snapshot["device_traces"]:
        for event in trace[-40:]:
            if event["action"] in ("alloc", "segment_alloc") and event["size"] <= 4096:
                frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
                          for f in event.get("frames", []) if "musebench" in f["filename"] or "tests" in f["filename"]]
                print(event["action"], event["size"], " <- ".join(frames[:6]))


if __name__ == "__main__":
    main()
