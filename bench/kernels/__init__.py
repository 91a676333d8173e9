"""The GPU kernels alone: `tandem bench gpu-profile` and `tandem bench kernel-resources`."""
