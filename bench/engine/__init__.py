"""The engine core in-process: `tandem bench gpu`, `cpu`, `cpu-profile`, `host`, and their harness."""
