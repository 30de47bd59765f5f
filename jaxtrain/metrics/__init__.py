"""What a run reports: metric sinks (``sinks``), console output (``console``), peak FLOP/s and
MFU (``flops``), profiler traces (``profile``)."""
