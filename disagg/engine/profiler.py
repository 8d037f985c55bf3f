"""TorchProfiler: a torch.profiler trace of what a node runs between two calls, vLLM's
`/start_profile` and `/stop_profile` (its `--profiler-config` or `VLLM_TORCH_PROFILER_DIR`).

The trace holds the CPU ops of every thread of the process and, on a GPU, every kernel and copy on
every stream (CUPTI): the engine's steps beside the KV pipe's receives, as a timeline to open in
Perfetto (https://ui.perfetto.dev). It is started and stopped on the engine thread, between steps;
under tensor parallelism it covers rank 0's process only.
"""

import glob
import os
from pathlib import Path

import torch


class TorchProfiler:
    def __init__(self, trace_dir: str | Path, worker_name: str):
        self.trace_dir = Path(trace_dir)
        self.worker_name = worker_name
        self.profile: torch.profiler.profile | None = None

    def start(self) -> None:
        if self.profile is not None:
            raise RuntimeError("the profiler is running already: POST /stop_profile first")
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.trace_dir), self.worker_name,
                                                                    use_gzip=True))
        self.profile.start()

    def stop(self) -> Path:
        """Stop and write the trace; the file written."""
        if self.profile is None:
            raise RuntimeError("the profiler is not running: POST /start_profile first")
        profile, self.profile = self.profile, None
        before = set(self._traces())
        profile.stop()  # on_trace_ready writes the file
        written = sorted(set(self._traces()) - before, key=os.path.getmtime)
        if not written:
            raise RuntimeError(f"the profiler wrote no trace into {self.trace_dir}")
        return Path(written[-1])

    def _traces(self) -> list[str]:
        return glob.glob(str(self.trace_dir / f"{glob.escape(self.worker_name)}*.pt.trace.json.gz"))
