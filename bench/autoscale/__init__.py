"""The autoscaling simulation of `tandem bench autoscale` (compare.py): trace, pods, scalers."""
