"""The machine: devices, precision, probes and peak FLOP/s."""
