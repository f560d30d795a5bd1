"""Tools over the library: the CLI, capabilities, the planner, quality and debug comparisons,
workloads and the router profiler."""
