"""TorchProfiler: a torch.profiler trace of what a node runs between two calls, vLLM's
`/start_profile` and `/stop_profile` (its `--profiler-config` or `VLLM_TORCH_PROFILER_DIR`).

The trace holds the CPU ops of every thread of the process (the engine's, the event loop's, the KV
pipe's senders and receivers, with their `disagg.*` marks: disagg/timeline.py) and, on a GPU, every
kernel and copy on every stream (CUPTI): the engine's steps beside the KV pipe's receives, as a
timeline to open in Perfetto (https://ui.perfetto.dev). It is started and stopped on the engine
thread, between steps, and written off it; under tensor parallelism it covers rank 0's process only.
"""

import time
from pathlib import Path

import torch


class TorchProfiler:
    def __init__(self, trace_dir: str | Path, worker_name: str):
        self.trace_dir = Path(trace_dir)
        self.worker_name = worker_name
        self.profile: torch.profiler.profile | None = None
        # A process's first profile imports torch.profiler's machinery: over a second on a CPU, several
        # on a busy GPU node. Here, as the node starts, rather than on the engine thread mid-serving.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            pass

    def start(self) -> None:
        if self.profile is not None:
            raise RuntimeError("the profiler is running already: POST /stop_profile first")
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # Every thread's ops, not only this one's (the engine thread's, which starts it).
        every_thread = torch.profiler._ExperimentalConfig(profile_all_threads=True)
        self.profile = torch.profiler.profile(activities=activities, experimental_config=every_thread)
        self.profile.start()

    def stop(self) -> torch.profiler.profile:
        """Stop profiling; `write` the profile it returns."""
        if self.profile is None:
            raise RuntimeError("the profiler is not running: POST /start_profile first")
        profile, self.profile = self.profile, None
        profile.stop()
        return profile

    def write(self, profile: torch.profiler.profile) -> Path:
        """Write a stopped profile's trace (gzipped Chrome trace JSON, as vLLM's); the file written.
        Seconds for a busy node's trace: not for the engine thread."""
        path = self.trace_dir / f"{self.worker_name}.{time.time_ns()}.pt.trace.json.gz"
        profile.export_chrome_trace(str(path))
        return path
