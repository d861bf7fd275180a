"""epbench: benchmark and bandwidth characterisation of MoE expert-parallel dispatch/combine."""

__version__ = "0.1.0"
