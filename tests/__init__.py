"""The test suite. A package only so that `tests.support` imports as one, whatever the working directory; the
layer folders (kv/, engine/, kernels/, notebook/, benchmarks/) are not packages: their files have unique names."""
