"""Tools around the engine, not part of serving: the perf bench (`python -m pocketlab.tools.bench`), the kernel
profile (`python -m pocketlab.tools.profile`), random-weight checkpoints (synthetic) and their timing helpers."""
