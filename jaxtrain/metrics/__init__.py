"""What a run reports: metric sinks (``sinks``), console output (``console``), per-device memory
(``memory``), peak FLOP/s and MFU (``flops``), profiler traces (``profile``)."""
