"""The autoscaling simulation of bench/autoscale_sim.py: trace, pods, scalers."""
