"""Developer tools run as commands: `python -m fmoe.tools.aot`, the Triton kernels' AOT compile report."""
