"""The engine on real-shaped workloads: `tandem bench workloads` and `tandem bench offload-bound`."""
